"""`phcd`'s mechanics: what is done to a request's global canvas, not what is decided about it
(that is `decoders/phcd.py`: the coarse and fine decisions, the commit controller, when to slide).

- `Plan`: one request's global canvas, positions [start, start + L) ahead of the committed prefix:
  input ids, last argmax, fine-step age, coarse-plan argmax and top-k self-conditioning, plus the
  rows committed last step that ride the next forward once more (promote late). `Plan.open` (a plan
  of noise), `Plan.window` (its rows as one `Window`: pending rows causal, the local window one
  canvas, the future block-causal in blocks of C on the coarse forwards), `Plan.update` (a pass's
  next inputs, decisions and self-conditioning), `Plan.slide` (past a commit: the rest kept, noise
  only where positions newly enter at the far end), `encode_item` / `agreement` (a commit's encoder
  item; its agreement with the coarse plan).
- the native sampler on a window (`official`'s rule, per request): `native_stats` (temperature by
  age, probabilities, entropy, argmax) and `native_draw` (its acceptance: a draw where kept, renoise
  elsewhere); `noise`: U(V) draws on the request's generator.
- `commit_sizes`: (min, max) tokens per commit by the task's family (`task_family`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from canvasq.decoders.configs import PhcdConfig, canvas_rows
from canvasq.decoders.sampling import SamplerSettings
from canvasq.model.windows import Window


def task_family(task: str | None) -> str:
    """The commit classes: maths / reasoning, code, text (anything else). Not `routing.task_kind`:
    that one has no `long` and counts gsm8k-style names as maths."""
    if task in ("math", "arith", "long"):
        return "math"
    if task == "code":
        return "code"
    return "text"


def commit_sizes(config: PhcdConfig, task: str | None, C: int) -> tuple[int, int]:
    """(min, max) tokens per commit for the task's family, on a canvas of C rows."""
    lo, hi = (x * config.commit_scale for x in getattr(config, f"{task_family(task)}_commit"))
    return canvas_rows(lo, C), max(canvas_rows(lo, C), canvas_rows(hi, C))


def native_stats(smp: SamplerSettings, logits: torch.Tensor, age: torch.Tensor):
    """The native sampler's view of a window's logits [W, V]: (logits under its linear temperature
    ramp by how many fine steps each row has had (`age` [W]), probabilities, entropy, argmax)."""
    if smp.t_min is not None:
        assert smp.t_max is not None  # set with t_min (`SamplerSettings.resolve`)
        left = torch.clamp(smp.steps - age, min=1).to(torch.float32)
        logits = logits / (smp.t_min + (smp.t_max - smp.t_min) * (left / smp.steps))[:, None]
    logp = torch.log_softmax(logits, dim=-1)
    probs = logp.exp()
    return logits, probs, -(probs * logp).sum(-1), logits.argmax(dim=-1)


def native_draw(smp: SamplerSettings, probs, entropy, gen: torch.Generator, renoise) -> torch.Tensor:
    """The native sampler's next input for a window: its acceptance (lowest entropy first while
    Σ H − max H ≤ the bound) keeps a draw from `probs`, `renoise(W)` fills the rest (drawn in
    that order on `gen`)."""
    sorted_h, order = torch.sort(entropy)
    keep = torch.zeros_like(entropy, dtype=torch.bool)
    keep[order] = torch.cumsum(sorted_h, 0) - sorted_h <= smp.entropy_bound
    sample = torch.multinomial(probs, 1, generator=gen).squeeze(-1)
    return torch.where(keep, sample, renoise(entropy.numel()))


def noise(gen: torch.Generator, n: int, vocab: int, device) -> torch.Tensor:
    """n draws of U(V) on the request's generator (the sampler's x_T and renoise), on `device`."""
    return torch.randint(0, vocab, (n,), generator=gen, device=gen.device).to(device)


@dataclass
class Plan:
    """One request's global canvas, positions [start, start + L). Tensors are [L] on the device."""

    start: int  # p: absolute position of the first uncommitted token
    tokens: torch.Tensor  # long: current input ids
    last: torch.Tensor  # long: last argmax decision at each position (-1: none yet)
    age: torch.Tensor  # long: fine steps each position has had in the local window
    sc_ids: torch.Tensor  # [L, k] long: top-k self-conditioning
    sc_vals: torch.Tensor  # [L, k] model dtype
    sc_have: torch.Tensor  # bool
    planned: torch.Tensor  # long: the coarse plan's last argmax at the position (-1: never planned)
    commit_lo: int
    commit_hi: int
    pending_ids: torch.Tensor | None = None  # committed last step, riding once more (promote late)
    pending_pos: torch.Tensor | None = None
    fine_since_commit: int = 0
    forwards: int = 0

    @classmethod
    def open(cls, start: int, tokens: torch.Tensor, k: int, dtype, commit: tuple[int, int]) -> Plan:
        """A plan of `tokens` (the noise) at `start`: no decision, plan or self-conditioning yet."""
        L, dev = int(tokens.numel()), tokens.device
        return cls(
            start=start,
            tokens=tokens,
            last=torch.full((L,), -1, dtype=torch.long, device=dev),
            age=torch.zeros(L, dtype=torch.long, device=dev),
            sc_ids=torch.zeros(L, k, dtype=torch.long, device=dev),
            sc_vals=torch.zeros(L, k, dtype=dtype, device=dev),
            sc_have=torch.zeros(L, dtype=torch.bool, device=dev),
            planned=torch.full((L,), -1, dtype=torch.long, device=dev),
            commit_lo=commit[0],
            commit_hi=commit[1],
        )

    @property
    def length(self) -> int:
        return int(self.tokens.numel())

    def window(self, slot: int, C: int, coarse_every: int) -> tuple[Window, tuple[int, int, int]]:
        """This forward's rows and their layout (pending, local W, future F; F = 0 but on the plan's
        first forward and every `coarse_every` after it):
        the pending rows with their final ids, causal; the window [p, p + W) one bidirectional
        canvas; the future block-causal behind it in blocks of C (a block sees the context, the
        window, the blocks before it and itself). Counts the forward."""
        L, p, dev = self.length, self.start, self.tokens.device
        W = min(C, L)
        F = L - W if self.forwards % coarse_every == 0 else 0
        k, dtype = self.sc_ids.shape[1], self.sc_vals.dtype
        ids, pos, lo, hi, sc_rows = [], [], [], [], []
        k_sc = [torch.zeros(0, k, dtype=torch.long, device=dev)]
        v_sc = [torch.zeros(0, k, dtype=dtype, device=dev)]
        n_pend = 0
        if self.pending_ids is not None:
            assert self.pending_pos is not None  # set with pending_ids (`slide`)
            n_pend = int(self.pending_ids.numel())
            ids.append(self.pending_ids)
            pos.append(self.pending_pos)
            lo.append(self.pending_pos)
            hi.append(self.pending_pos + 1)
            sc_rows.append(torch.zeros(n_pend, dtype=torch.bool, device=dev))
            k_sc.append(torch.zeros(n_pend, k, dtype=torch.long, device=dev))
            v_sc.append(torch.zeros(n_pend, k, dtype=dtype, device=dev))
        rel = torch.arange(W + F, device=dev)
        block_lo = torch.where(rel < W, 0, W + ((rel - W) // C) * C)
        block_hi = torch.where(rel < W, W, torch.clamp(block_lo + C, max=W + F))
        ids.append(self.tokens[: W + F])
        pos.append(p + rel)
        lo.append(p + block_lo)
        hi.append(p + block_hi)
        sc_rows.append(self.sc_have[: W + F])
        k_sc.append(self.sc_ids[: W + F])
        v_sc.append(self.sc_vals[: W + F])
        w = Window(
            slot,
            torch.cat(ids),
            torch.cat(pos),
            torch.cat(lo),
            torch.cat(hi),
            self_cond=(torch.cat(k_sc), torch.cat(v_sc)),
            self_cond_rows=torch.cat(sc_rows),
        )
        self.forwards += 1
        return w, (n_pend, W, F)

    def encode_item(self, slot: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        """The rows just committed as an encoder item (slot, ids, positions), taken off the plan."""
        ids, pos = self.pending_ids, self.pending_pos
        assert ids is not None and pos is not None  # set by `slide`
        self.pending_ids = self.pending_pos = None
        return slot, ids, pos

    def agreement(self, toks: torch.Tensor) -> tuple[int, int]:
        """Committed `toks` against the coarse plan's last decision at their positions: (positions the
        plan had drafted, positions where it agreed)."""
        planned = self.planned[: toks.numel()]
        return int((planned >= 0).sum()), int((planned == toks).sum())

    def update(self, rows: slice, tokens: torch.Tensor, decision: torch.Tensor, logits: torch.Tensor) -> None:
        """After a pass over `rows`: their next input ids, their argmax `decision`, and the top-k of the
        pass's `logits` as the next forward's self-conditioning."""
        self.tokens[rows] = tokens
        self.last[rows] = decision
        vals, ids = torch.topk(logits.float(), self.sc_ids.shape[1], dim=-1)
        self.sc_ids[rows] = ids
        self.sc_vals[rows] = vals.to(self.sc_vals.dtype)
        self.sc_have[rows] = True

    def slide(self, toks: torch.Tensor, ahead: int | None, fresh_noise) -> tuple[int, int]:
        """`toks` committed at the plan's start: they become the pending rows and the plan starts after
        them. With `ahead` (positions still inside the N windows and the answer's budget; None: the
        answer has ended) the rest is kept (tokens, decisions, self-conditioning) and `fresh_noise(n)`
        fills the positions that newly enter at the far end. Returns (kept, fresh) rows."""
        n = int(toks.numel())
        self.pending_ids = toks.clone()
        self.pending_pos = torch.arange(self.start, self.start + n, device=self.tokens.device)
        self.start += n
        self.fine_since_commit = 0
        if ahead is None:
            return 0, 0
        kept = self.length - n
        fresh = max(0, ahead - kept)
        keep = slice(n, self.length)
        self.tokens = torch.cat([self.tokens[keep], fresh_noise(fresh)])[:ahead]
        self.last = _extend(self.last[keep], fresh, -1)[:ahead]
        self.age = _extend(self.age[keep], fresh, 0)[:ahead]
        self.planned = _extend(self.planned[keep], fresh, -1)[:ahead]
        self.sc_have = _extend(self.sc_have[keep], fresh, False)[:ahead]
        self.sc_ids = _extend(self.sc_ids[keep], fresh, 0)[:ahead]
        self.sc_vals = _extend(self.sc_vals[keep], fresh, 0)[:ahead]
        return kept, fresh


def _extend(t: torch.Tensor, n: int, value) -> torch.Tensor:
    """`t` with n more leading-dimension entries of `value` at its end."""
    return torch.cat([t, torch.full((n, *t.shape[1:]), value, dtype=t.dtype, device=t.device)])
