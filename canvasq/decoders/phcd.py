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

Flow: DecodeBatch → `Seq` + `Plan` per request (`phcd_plan`: its state, window layout, noise, slide)
→ one `Window` per live request per forward (pending | local | future) → `Runtime.decode` → the
native sampler's statistics → coarse pass + fine step + commit controller + slide → DecodeResult.
"""

from __future__ import annotations

import torch

from canvasq.decoders.base import StepDecoder
from canvasq.decoders.configs import OfficialConfig, PhcdConfig
from canvasq.decoders.phcd_plan import Plan, commit_sizes, native_draw, native_stats, noise
from canvasq.decoders.sampling import SamplerSettings
from canvasq.decoders.state import Seq, row_generator
from canvasq.decoders.types import FinishReason


class PhcdDecoder(StepDecoder):
    name = "phcd"
    config_cls = PhcdConfig

    def __init__(self, bundle, config: PhcdConfig | None = None):
        super().__init__(bundle, config)
        # the fine sampler is the native one: the checkpoint's temperatures and entropy bound
        self.sampler = SamplerSettings.resolve(
            self.model, OfficialConfig(entropy_bound=self.config.entropy_bound)
        )
        self.V = self.rt.vocab_size
        self.k = min(self.config.sc_topk, self.V)
        self._plans: dict[int, Plan] = {}

    # -- hooks of the base loop -------------------------------------------------------------------
    def pick_model(self):
        """`adapter="repair"`: the D2F model with the repair-trained LoRA merged on top."""
        if self.config.adapter == "repair":
            return self.bundle.phcd_repair_model()
        return super().pick_model()

    def generator(self, seed: int, custom_id: str) -> torch.Generator:
        """On the model's device: the multinomial draws need a generator where the probabilities are."""
        return torch.Generator(device=self.device).manual_seed(row_generator(seed, custom_id).initial_seed())

    def need(self, req) -> int:
        """Prompt, every committed token, and the scratch of one forward (pending + global canvas)."""
        return len(req.prompt_ids) + req.max_tokens + (self.config.windows + 1) * self.C + 8

    def step_budget(self, seqs: list[Seq]) -> int:
        """The controller commits ≥ 1 token at least every `max_fine_steps` forwards."""
        return max(s.req.max_tokens for s in seqs) * self.config.max_fine_steps + 16

    def spawn(self, s: Seq):
        """The global canvas: N windows of U(V) noise after the prompt (the sampler's x_T)."""
        L = min(self.config.windows * self.C, s.req.max_tokens)
        tokens, sizes = noise(s.gen, L, self.V, self.device), commit_sizes(self.config, s.req.task, self.C)
        plan = self._plans[s.row] = Plan.open(s.prompt_len, tokens, self.k, self.rt.dtype, sizes)
        s.spawned = 1
        s.stats["fresh_rows"] += L
        return plan

    # -- one step ---------------------------------------------------------------------------------
    def step(self, seqs: list[Seq]) -> None:
        """One forward: each request's window (with the future at the coarse rate: `Plan.window`), then per
        request the late promotion of last step's commits, the coarse pass, the fine step, its commits."""
        built = [self._plans[s.row].window(s.slot, self.C, self.config.coarse_every) for s in seqs]
        windows = [w for w, _ in built]
        with self.timed() as t:
            out = self.forward(windows)
        commits: dict[int, int] = {}
        encodes: list[tuple[Seq, tuple[int, torch.Tensor, torch.Tensor]]] = []  # (request, encode item)
        for b, (s, (_, (n_pend, W, F))) in enumerate(zip(seqs, built)):
            plan = self._plans[s.row]
            plan.pending_ids = plan.pending_pos = None
            if n_pend and self.config.promote == "late":
                assert self.arena is not None  # the stream's
                self.arena.promote_window(s.slot, list(range(n_pend)))
                s.stats["promoted"] += n_pend
            logits = out.window_logits(b)
            if F:
                self._coarse(s, plan, logits[n_pend + W :], W)
            commits[s.row] = self._fine(s, plan, logits[n_pend : n_pend + W])
            if commits[s.row] and self.config.promote == "encode" and not s.done:
                encodes.append((s, plan.encode_item(s.slot)))  # the rows `_commit` just committed
        states = {s.row: "local,coarse" if lay[2] else "local" for s, (_, lay) in zip(seqs, built)}
        self.record("decode", t.ms, {s.row: w.rows for s, w in zip(seqs, windows)}, commits, states)
        self.note_emitted(seqs)
        self.encode_commits(encodes)  # promote="encode": every request's committed rows in one causal pass
        for s in seqs:
            if s.done:
                self._plans.pop(s.row, None)

    # -- coarse: the future ------------------------------------------------------------------------
    def _coarse(self, s: Seq, plan: Plan, logits: torch.Tensor, W: int) -> None:
        """Argmax renoise and self-conditioning of the future rows (drafts: nothing commits here)."""
        arg = logits.argmax(dim=-1)
        rows = slice(W, W + logits.shape[0])
        plan.planned[rows] = arg
        plan.update(rows, arg, arg, logits)
        s.stats["coarse_passes"] += 1
        s.stats["coarse_rows"] += int(logits.shape[0])

    # -- fine: the local window and the commit controller ----------------------------------------
    def _fine(self, s: Seq, plan: Plan, logits: torch.Tensor) -> int:
        """The native sampler's step on the window, then the commit controller; returns the tokens
        committed."""
        W = logits.shape[0]
        logits, probs, entropy, arg = native_stats(self.sampler, logits, plan.age[:W])

        # the safe prefix: leading positions whose decision repeats, with low entropy
        safe = (arg == plan.last[:W]) & (entropy <= self.config.safe_entropy)
        run = int(torch.cumprod(safe.long(), 0).sum())
        plan.fine_since_commit += 1
        n = self._commit_count(s, plan, arg, run, W)

        # the window's next input: the native sampler's draw where its acceptance keeps, U(V) elsewhere
        nxt = native_draw(self.sampler, probs, entropy, s.gen, lambda m: noise(s.gen, m, self.V, self.device))
        plan.age[:W] += 1
        plan.update(slice(0, W), nxt, arg, logits)
        if n:
            rows, agree = plan.agreement(arg[:n])  # the global-local contradiction rate: 1 − agree / rows
            s.stats["plan_rows"] += rows
            s.stats["plan_agree"] += agree
            self._commit(s, plan, arg[:n])
        return n

    def _commit_count(self, s: Seq, plan: Plan, arg: torch.Tensor, run: int, W: int) -> int:
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

    def _commit(self, s: Seq, plan: Plan, toks: torch.Tensor) -> None:
        """Append the committed tokens, slide the global canvas by their count, keep the rest of it
        (future repair) and draw U(V) only for the positions that newly enter at its far end."""
        n, out = int(toks.numel()), toks.tolist()
        s.stats["commits"] += n
        s.stats["commit_events"] += 1
        s.out.extend(out)
        if self._ends_at_stop(s, out):
            s.done, s.finish_reason = True, FinishReason.stop
        elif len(s.out) >= s.req.max_tokens:
            s.done, s.finish_reason = True, FinishReason.length
        # the tail: positions still inside both N windows ahead and the answer's budget
        ahead = None if s.done else min(self.config.windows * self.C, s.req.max_tokens - len(s.out))
        kept, fresh = plan.slide(toks, ahead, lambda m: noise(s.gen, m, self.V, self.device))
        if ahead is not None:
            s.stats["repaired_rows"] += kept
            s.stats["fresh_rows"] += fresh
