"""`phcd`: Progressive Hierarchical Canvas Diffusion.

Per request a *global canvas* of N local windows (`windows`, N × C positions, never past the answer's
token budget) is kept alive ahead of the committed prefix p:

    | prompt + committed (arena) | pending | local window [p, p+W) | future [p+W, p+L), blocks of C |
                                   ^ committed last step, riding once more (promote one step late)

- **fine step** (every forward): the local window is refined with the native sampler's rule
  (`official`): temperature by the row's age, entropy-bound acceptance re-decided every step, fresh
  U(V) noise elsewhere, top-k self-conditioning. The window is one bidirectional canvas of C rows.
- **coarse step** (the first forward, then every `coarse_every` forwards): the future rides the same
  forward as block-causal blocks of C behind the window (a block sees the context, the window, the
  blocks before it and itself, never a later one: the D2F layout), argmax renoise, self-conditioned,
  never committing. This is the "low rate" of the global plan.
- **commit controller**: after a fine step the *safe prefix* is the run of leading window positions
  whose argmax repeats the previous decision (fine or coarse) with entropy ≤ `safe_entropy`. It is
  committed when it reaches the task's minimum, capped at the task's maximum (per-task sizes given for
  256-token canvases, scaled to the model's: `configs.canvas_rows`); after `max_fine_steps` forwards
  without a commit the minimum is committed anyway (the window never stalls). A committed EOS / PAD
  ends the answer. Commits are final (no rollback buffer).
- **future repair**: after a commit the window slides by the committed count. The rest of the window
  and the whole future are *kept* (tokens, self-conditioning, last argmax), not redrawn: the rows that
  slide into the window start from the plan, and the next coarse pass re-conditions the kept future
  on the new prefix. Only the positions that newly enter the global canvas at its far end are drawn
  from U(V).
- **committed K/V**: `promote="late"` (default): the committed rows ride the next forward with their
  final ids as causal rows (`canvas_end = position + 1`) and their decoder K/V is promoted into the
  arena from the window's scratch (Funnel's promote one step late; decoder K/V approximates encoder
  K/V: CONTRACTS.md). `promote="encode"`: one encoder pass over the committed rows (exact, one more
  forward per commit).
- **weights**: the D2F adapter merged (`adapter=True`, default), the base (`False`), or the D2F model
  with the repair-trained LoRA merged on top (`adapter="repair"`: `<dir>/phcd_adapter/`, trained by
  `python -m canvasq.testbed.repair` on local-refinement, commit-consistency and future-repair
  objectives; BENCHMARKS.md "PHCD prototype" has its A/B).

Flow: DecodeBatch → `Seq` + `_Plan` per request → one `Window` per live request per forward
(pending | local | future) → `Runtime.decode` → fine sampler + commit controller + slide → DecodeResult.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from canvasq.decoders.base import StepDecoder
from canvasq.decoders.configs import OfficialConfig, PhcdConfig, canvas_rows
from canvasq.decoders.state import Seq, row_generator
from canvasq.decoders.types import FinishReason


def task_family(task: str | None) -> str:
    """The commit classes: maths / reasoning, code, text (anything else)."""
    if task in ("math", "arith", "long"):
        return "math"
    if task == "code":
        return "code"
    return "text"


@dataclass
class _Plan:
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

    @property
    def length(self) -> int:
        return int(self.tokens.numel())


class PhcdDecoder(StepDecoder):
    name = "phcd"
    config_cls = PhcdConfig

    def __init__(self, bundle, config: PhcdConfig | None = None):
        super().__init__(bundle, config)
        from canvasq.decoders.sampling import SamplerSettings

        # the fine sampler is the native one: the checkpoint's temperatures and entropy bound
        self.sampler = SamplerSettings.resolve(
            self.model, OfficialConfig(entropy_bound=self.config.entropy_bound)
        )
        self.V = self.rt.vocab_size
        self.k = min(self.config.sc_topk, self.V)
        self._plans: dict[int, _Plan] = {}

    # -- hooks of the base loop -------------------------------------------------------------------
    def pick_model(self):
        """`adapter="repair"`: the D2F model with the repair-trained LoRA merged on top."""
        if self.config.adapter == "repair":
            return self.bundle.phcd_repair_model()
        return super().pick_model()

    def generator(self, seed: int, custom_id: str) -> torch.Generator:
        """On the model's device: the multinomial draws need a generator where the probabilities are."""
        g = torch.Generator(device=self.device)
        g.manual_seed(row_generator(seed, custom_id).initial_seed())
        return g

    def need(self, req) -> int:
        """Prompt, every committed token, and the scratch of one forward (pending + global canvas)."""
        return len(req.prompt_ids) + req.max_tokens + (self.config.windows + 1) * self.C + 8

    def step_budget(self, seqs: list[Seq]) -> int:
        """The controller commits ≥ 1 token at least every `max_fine_steps` forwards."""
        return max(s.req.max_tokens for s in seqs) * self.config.max_fine_steps + 16

    def commit_sizes(self, task: str | None) -> tuple[int, int]:
        """(min, max) tokens per commit for the task's family, on this model's canvas."""
        lo, hi = (x * self.config.commit_scale for x in getattr(self.config, f"{task_family(task)}_commit"))
        return canvas_rows(lo, self.C), max(canvas_rows(lo, self.C), canvas_rows(hi, self.C))

    def spawn(self, s: Seq):
        """The global canvas: N windows of U(V) noise after the prompt (the sampler's x_T)."""
        L = min(self.config.windows * self.C, s.req.max_tokens)
        lo, hi = self.commit_sizes(s.req.task)
        plan = _Plan(
            start=s.prompt_len,
            tokens=self._noise(s, L),
            last=torch.full((L,), -1, dtype=torch.long, device=self.device),
            age=torch.zeros(L, dtype=torch.long, device=self.device),
            sc_ids=torch.zeros(L, self.k, dtype=torch.long, device=self.device),
            sc_vals=torch.zeros(L, self.k, dtype=self.rt.dtype, device=self.device),
            sc_have=torch.zeros(L, dtype=torch.bool, device=self.device),
            planned=torch.full((L,), -1, dtype=torch.long, device=self.device),
            commit_lo=lo,
            commit_hi=hi,
        )
        self._plans[s.row] = plan
        s.spawned = 1
        s.stats["fresh_rows"] += L
        return plan

    def _noise(self, s: Seq, n: int) -> torch.Tensor:
        return torch.randint(0, self.V, (n,), generator=s.gen, device=s.gen.device).to(self.device)

    # -- one step ---------------------------------------------------------------------------------
    def step(self, seqs: list[Seq]) -> None:
        built = [self._window(s) for s in seqs]
        windows = [w for w, _ in built]
        with self.timed() as t:
            out = self.forward(windows)
        commits: dict[int, int] = {}
        encodes: list[tuple[Seq, tuple[int, torch.Tensor, torch.Tensor]]] = []  # (request, encode item)
        for b, (s, (w, layout)) in enumerate(zip(seqs, built)):
            plan = self._plans[s.row]
            n_pend, W, F = layout
            if n_pend and self.config.promote == "late":
                assert self.arena is not None  # the stream's
                self.arena.promote_window(s.slot, list(range(n_pend)))
                s.stats["promoted"] += n_pend
            plan.pending_ids = plan.pending_pos = None
            logits = out.window_logits(b)
            if F:
                self._coarse(s, plan, logits[n_pend + W :], W)
            commits[s.row] = self._fine(s, plan, logits[n_pend : n_pend + W])
            if commits[s.row] and self.config.promote == "encode" and not s.done:
                ids, pos = plan.pending_ids, plan.pending_pos
                assert ids is not None and pos is not None  # the rows `_commit` just committed
                encodes.append((s, (s.slot, ids, pos)))
                plan.pending_ids = plan.pending_pos = None
        states = {s.row: "local,coarse" if lay[2] else "local" for s, (_, lay) in zip(seqs, built)}
        self.record("decode", t.ms, {s.row: w.rows for s, w in zip(seqs, windows)}, commits, states)
        self.note_emitted(seqs)
        if encodes:  # promote="encode": the committed rows of every request in one causal pass
            with self.timed() as t:
                self.encode([item for _, item in encodes])
            self.record(
                "encode",
                t.ms,
                {s.row: int(item[1].numel()) for s, item in encodes},
                {},
                {s.row: "commit" for s, _ in encodes},
            )
        for s in seqs:
            if s.done:
                self._plans.pop(s.row, None)

    def _window(self, s: Seq):
        """(the request's window, (pending rows, local rows, future rows)). The future rides on the
        request's first forward and every `coarse_every` forwards after it."""
        from canvasq.model.runtime import Window

        plan = self._plans[s.row]
        L, C, p = plan.length, self.C, plan.start
        W = min(C, L)
        F = L - W if plan.forwards % self.config.coarse_every == 0 else 0
        ids, pos, lo, hi, sc_rows = [], [], [], [], []
        k_sc = [torch.zeros(0, self.k, dtype=torch.long, device=self.device)]
        v_sc = [torch.zeros(0, self.k, dtype=self.rt.dtype, device=self.device)]
        n_pend = 0
        pend_ids, pend_pos = plan.pending_ids, plan.pending_pos
        if pend_ids is not None and self.config.promote == "late":
            # promote one step late: committed rows ride once more with their final ids, causally
            assert pend_pos is not None  # set with pending_ids (`_commit`)
            n_pend = int(pend_ids.numel())
            ids.append(pend_ids)
            pos.append(pend_pos)
            lo.append(pend_pos)
            hi.append(pend_pos + 1)
            sc_rows.append(torch.zeros(n_pend, dtype=torch.bool, device=self.device))
            k_sc.append(torch.zeros(n_pend, self.k, dtype=torch.long, device=self.device))
            v_sc.append(torch.zeros(n_pend, self.k, dtype=self.rt.dtype, device=self.device))
        rel = torch.arange(W + F, device=self.device)
        # the window is one canvas [p, p + W); the future is block-causal in blocks of C behind it
        block_lo = torch.where(rel < W, 0, W + ((rel - W) // C) * C)
        block_hi = torch.where(rel < W, W, torch.clamp(block_lo + C, max=W + F))
        ids.append(plan.tokens[: W + F])
        pos.append(p + rel)
        lo.append(p + block_lo)
        hi.append(p + block_hi)
        sc_rows.append(plan.sc_have[: W + F])
        k_sc.append(plan.sc_ids[: W + F])
        v_sc.append(plan.sc_vals[: W + F])
        w = Window(
            s.slot,
            torch.cat(ids),
            torch.cat(pos),
            torch.cat(lo),
            torch.cat(hi),
            self_cond=(torch.cat(k_sc), torch.cat(v_sc)),
            self_cond_rows=torch.cat(sc_rows),
        )
        plan.forwards += 1
        if F:
            s.stats["coarse_passes"] += 1
        return w, (n_pend, W, F)

    # -- coarse: the future ------------------------------------------------------------------------
    def _coarse(self, s: Seq, plan: _Plan, logits: torch.Tensor, W: int) -> None:
        """Argmax renoise and self-conditioning of the future rows (drafts: nothing commits here)."""
        arg = logits.argmax(dim=-1)
        rows = slice(W, W + logits.shape[0])
        plan.tokens[rows] = arg
        plan.last[rows] = arg
        plan.planned[rows] = arg
        self._store_sc(plan, rows, logits)
        s.stats["coarse_rows"] += int(logits.shape[0])

    # -- fine: the local window and the commit controller ----------------------------------------
    def _fine(self, s: Seq, plan: _Plan, logits: torch.Tensor) -> int:
        """The native sampler's step on the window, then the commit controller; returns the tokens
        committed."""
        smp, cfg = self.sampler, self.config
        W = logits.shape[0]
        if smp.t_min is not None:  # the sampler's linear ramp, by how many fine steps a row has had
            assert smp.t_max is not None  # set with t_min (`SamplerSettings.resolve`)
            left = torch.clamp(smp.steps - plan.age[:W], min=1).to(torch.float32)
            logits = logits / (smp.t_min + (smp.t_max - smp.t_min) * (left / smp.steps))[:, None]
        logp = torch.log_softmax(logits, dim=-1)
        probs = logp.exp()
        entropy = -(probs * logp).sum(-1)
        arg = logits.argmax(dim=-1)

        # the safe prefix: leading positions whose decision repeats, with low entropy
        safe = (arg == plan.last[:W]) & (entropy <= cfg.safe_entropy)
        run = int(torch.cumprod(safe.long(), 0).sum())
        plan.fine_since_commit += 1
        n = self._commit_count(s, plan, arg, run, W)

        # the sampler's acceptance, re-decided every step: lowest entropy while Σ H − max H ≤ bound
        sorted_h, order = torch.sort(entropy)
        keep = torch.zeros_like(safe)
        keep[order] = torch.cumsum(sorted_h, 0) - sorted_h <= smp.entropy_bound
        sample = torch.multinomial(probs, 1, generator=s.gen).squeeze(-1)
        plan.tokens[:W] = torch.where(keep, sample, self._noise(s, W))
        plan.last[:W] = arg
        plan.age[:W] += 1
        self._store_sc(plan, slice(0, W), logits)
        if n:
            # plan agreement (the global-local contradiction rate is 1 − agree / rows):
            # committed tokens against the coarse plan's last decision at their position
            planned = plan.planned[:n]
            s.stats["plan_rows"] += int((planned >= 0).sum())
            s.stats["plan_agree"] += int((planned == arg[:n]).sum())
            self._commit(s, plan, arg[:n])
        return n

    def _commit_count(self, s: Seq, plan: _Plan, arg: torch.Tensor, run: int, W: int) -> int:
        """How many leading window tokens the controller commits this step (0: keep refining)."""
        lo, hi = plan.commit_lo, plan.commit_hi
        room = s.req.max_tokens - len(s.out)
        stops = [i for i, t in enumerate(arg[: min(run, hi)].tolist()) if t in self.stop_ids]
        if stops:  # the answer's end is in the safe prefix: commit through it, whatever the minimum
            return stops[0] + 1
        n = min(run, hi, room)
        if n >= lo or n == room:
            return n
        if plan.fine_since_commit >= self.config.max_fine_steps:
            s.stats["forced_commits"] += 1
            return min(lo, room, W)
        return 0

    def _ends_at_stop(self, s: Seq, out: list[int]) -> bool:
        """A committed EOS (or PAD) in `out` ends `s`'s answer."""
        return any(t in self.stop_ids for t in out)

    def _commit(self, s: Seq, plan: _Plan, toks: torch.Tensor) -> None:
        """Append the committed tokens, slide the global canvas by their count, keep the rest of it
        (future repair) and draw U(V) only for the positions that newly enter at its far end."""
        n = int(toks.numel())
        s.stats["commits"] += n
        s.stats["commit_events"] += 1
        out = toks.tolist()
        s.out.extend(out)
        plan.pending_ids = toks.clone()
        plan.pending_pos = torch.arange(plan.start, plan.start + n, device=self.device)
        plan.start += n
        plan.fine_since_commit = 0
        if self._ends_at_stop(s, out):
            s.done, s.finish_reason = True, FinishReason.stop
            return
        if len(s.out) >= s.req.max_tokens:
            s.done, s.finish_reason = True, FinishReason.length
            return
        # the tail: positions still inside both N windows ahead and the answer's budget
        ahead = min(self.config.windows * self.C, s.req.max_tokens - len(s.out))
        fresh = max(0, ahead - (plan.length - n))
        keep = slice(n, plan.length)
        s.stats["repaired_rows"] += plan.length - n
        s.stats["fresh_rows"] += fresh
        plan.tokens = torch.cat([plan.tokens[keep], self._noise(s, fresh)])[:ahead]
        plan.last = _extend(plan.last[keep], fresh, -1)[:ahead]
        plan.age = _extend(plan.age[keep], fresh, 0)[:ahead]
        plan.planned = _extend(plan.planned[keep], fresh, -1)[:ahead]
        plan.sc_have = _extend(plan.sc_have[keep], fresh, False)[:ahead]
        plan.sc_ids = torch.cat([plan.sc_ids[keep], plan.sc_ids.new_zeros(fresh, self.k)])[:ahead]
        plan.sc_vals = torch.cat([plan.sc_vals[keep], plan.sc_vals.new_zeros(fresh, self.k)])[:ahead]

    def _store_sc(self, plan: _Plan, rows: slice, logits: torch.Tensor) -> None:
        vals, ids = torch.topk(logits.float(), self.k, dim=-1)
        plan.sc_ids[rows] = ids
        plan.sc_vals[rows] = vals.to(self.rt.dtype)
        plan.sc_have[rows] = True


def _extend(t: torch.Tensor, n: int, value) -> torch.Tensor:
    return torch.cat([t, torch.full((n,), value, dtype=t.dtype, device=t.device)])
