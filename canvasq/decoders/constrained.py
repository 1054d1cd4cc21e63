"""`official`'s structured output: the rows with a `response_format` schema held to it, canvas by canvas
(`decoders.structured` has the method). The decoder calls four hooks:

- `begin(s, cv)` when a row's canvas is spawned: the canvas's token masks from the automaton state its
  committed answer reached and the answer tokens left (`Grammar.plan`, built on the device);
- `mask(seqs, logits)` after each decoder forward: every constrained row's logits outside its masks set
  to `NEG` in place, so the sampler's draws, argmax, entropies (the acceptance and stopping rules) and
  self-conditioning all see only tokens some valid completion allows (scaffold positions have one
  token: entropy 0, accepted at the first step); with `settle` (OfficialConfig.constraint_settle), a
  canvas whose best valid path has held that many steps is pinned to it (`constraint_rules.settle_rule`; with `think`, not
  a canvas whose path is thought only: official's own rule ends those, as it ends free text), and with
  `settle_positions` the document's positions whose tokens on that path have held that long are
  pinned from its start, before the whole path holds (an array's length or an enum the model stays
  unsure of would otherwise keep the canvas to the step cap); with `open_hold`, a thinking row's
  document starts where the model's argmax has held its opening brace (`constraint_rules.open_rule`).
  The rules' state lives on the device and nothing is read back mid-step;
- `final(finished, tokens)` when canvases stop: a constrained row's tokens are the best completable
  path under its last logits (`Grammar.best`, on the device, found by `mask` in the same step, read
  after the step's sync), not the per-position argmax;
- `checked(s, result)` for every finished row: its text parsed and validated against the schema
  (jsonschema); a row that fails is an error with code `invalid_structured_output` (it cannot happen
  by construction; the check makes sure), never a done row with invalid JSON.

Each row's `stats["constraint_host_us"]` sums the host time these hooks spent on it.
"""

from __future__ import annotations

import functools
import json
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from canvasq.decoders.constraint_rules import (
    COUNTERS,
    NEG,
    SlotRules,
    StepRows,
    opens_document,
    pin,
    step_rules,
)
from canvasq.decoders.grammar_device import device_grammar
from canvasq.decoders.state import Canvas, Seq
from canvasq.decoders.structured import (
    Grammar,
    TokenTexts,
    Unfinishable,
    cached_grammar,
    output_problem,
    schema_check,
    split_thought,
    token_texts,
)
from canvasq.decoders.types import DecodeResult, FinishReason
from canvasq.model.windows import to_device

UNFINISHABLE = "structured_output_unfinishable"
# rows x C x V at most for the masks applied as one select (64 MiB of bool; the testbed's 64-row group:
# 1.5 M): above it, one masked fill a row
BAN_STACK_ELEMENTS = 1 << 26
# the plans `kernels.constrain` reads, at most (the testbed's: 24 KiB each; a real-shape plan: 64 MiB)
PLAN_TABLE_BYTES = 1 << 28
INVALID = "invalid_structured_output"


@dataclass
class RowGrammar:
    grammar: Grammar
    state: int  # the automaton's state after the committed answer
    banned: torch.Tensor | None = None  # [C, V] bool on the device: the front canvas's banned tokens
    plan: tuple | None = None  # what `banned` was planned from (grammar, state, budget): its table key
    back: int | None = None  # the canvas budget's backward sets in its device grammar's table (`back_index`)
    steps: int = 0  # the front canvas's masked steps (its rules' state is on the device: `SlotRules`)


class PlanTable:
    """The constrained rows' plans as one [P, C, V] bool device tensor, so one launch
    (`kernels.constrain`) reads each row's by its index: a plan is copied in the first step a row
    needs it (from the grammar's cache of plans), and the table starts over when a step's plans do not
    fit beside the ones it holds (`max_bytes`)."""

    def __init__(self, C: int, V: int, device: torch.device, max_bytes: int = PLAN_TABLE_BYTES):
        self.cap = max_bytes // (C * V)
        self.plans = torch.empty(0, C, V, dtype=torch.bool, device=device)
        self.index: dict[tuple | None, int] = {}  # by `RowGrammar.plan`

    def ids(self, rows: list[RowGrammar]) -> list[int] | None:
        """Each row's plan's index in `plans`, or None when the rows' distinct plans exceed the table
        (the caller masks without it)."""
        new = {row.plan: row.banned for row in rows if row.plan not in self.index}
        if len(self.index) + len(new) > self.cap:  # full: only this step's plans
            new = {row.plan: row.banned for row in rows}
            if len(new) > self.cap:
                return None
            self.index = {}
        if new:
            self._add(new)
        return [self.index[row.plan] for row in rows]

    def _add(self, new: dict) -> None:
        n = len(self.index)
        if n + len(new) > len(self.plans):  # grown by doubling, up to the cap
            grown = self.plans.new_empty((min(self.cap, max(8, 2 * (n + len(new)))), *self.plans.shape[1:]))
            grown[:n] = self.plans[:n]
            self.plans = grown
        for k, (key, banned) in enumerate(new.items(), n):
            self.plans[k].copy_(banned)
            self.index[key] = k


def bundle_texts(bundle) -> TokenTexts:
    """The bundle's token texts (its directory's `tokenizer.json`; the testbed's for random weights)."""
    from canvasq.model.loading import DEFAULT_MODEL_DIR

    path = Path(bundle.spec) / "tokenizer.json"
    if not path.is_file():
        path = DEFAULT_MODEL_DIR / "tokenizer.json"
    return token_texts(str(path), bundle.eos_id, bundle.pad_id)


class CanvasConstraints:
    """Per-row automata of one decoder's stream (keyed by `Seq.row`); the rules' per-canvas state on
    the device, by slot (`constraint_rules.SlotRules`)."""

    def __init__(
        self,
        bundle,
        C: int,
        V: int,
        device: torch.device,
        settle: int | None = None,
        settle_positions: int | None = None,
        max_steps: int | None = None,
        open_hold: int | None = None,
    ):
        self.bundle, self.C, self.V, self.device, self.settle = bundle, C, V, device, settle
        self.settle_positions, self.max_steps, self.open_hold = settle_positions, max_steps, open_hold
        self._texts: TokenTexts | None = None
        self._opens: torch.Tensor | None = None
        self._opens_list: list[bool] | None = None
        self.rows: dict[int, RowGrammar] = {}
        # `_check`'s, gone with their grammar (the grammars' cache is bounded; a worker meets many schemas)
        self._checks: weakref.WeakKeyDictionary[Grammar, Callable[[str], str | None]] = (
            weakref.WeakKeyDictionary()
        )
        self.slots = SlotRules(C, device)
        self._fresh: set[int] = set()  # slots whose canvas began since their last masked step
        self._host_us = np.zeros(0)  # per slot: `mask`'s host time not yet in its row's stats
        self.table = PlanTable(C, V, device)
        # mask and pin through `kernels.constrain` and `kernels.rules` (None: on CUDA)
        self.kernels: bool | None = None

    def texts(self) -> TokenTexts:
        if self._texts is None:
            self._texts = bundle_texts(self.bundle)
        return self._texts

    def opens(self) -> torch.Tensor:
        """[V] bool on the device: the tokens that open a document (`opens_document`)."""
        if self._opens is None:
            self._opens = torch.tensor(self._opens_host()[: self.V], dtype=torch.bool).to(self.device)
        return self._opens

    def _opens_host(self) -> list[bool]:
        """`opens` as a host list (every finished thinking row's thought length reads it)."""
        if self._opens_list is None:
            texts = self.texts().texts
            self._opens_list = [opens_document(t) for t in texts] + [False] * max(0, self.V - len(texts))
        return self._opens_list

    def reset(self) -> None:
        self.rows, self._fresh = {}, set()
        self._host_us[:] = 0.0

    def begin(self, s: Seq, cv: Canvas) -> None:
        schema = s.req.response_format
        if schema is None or s.done:
            return
        t0 = time.perf_counter()
        row = self.rows.get(s.row)
        if row is None:
            grammar = cached_grammar(schema, self.texts(), s.req.think)
            row = self.rows[s.row] = RowGrammar(grammar, 0)
            row.state = row.grammar.start
        budget = s.req.max_tokens - cv.index * self.C
        dg = device_grammar(row.grammar, self.device)
        try:
            row.banned = dg.banned(row.state, self.C, budget, self.V)
            row.plan = (row.grammar, row.state, budget)
        except Unfinishable as exc:
            s.error, s.done = f"{UNFINISHABLE}: {exc}", True
            return
        row.back = dg.back_index(self.C, budget)
        row.steps = 0
        self._fresh.add(s.slot)
        s.stats["constraint_host_us"] += int(1e6 * (time.perf_counter() - t0))

    def mask(self, seqs: list[Seq], logits: torch.Tensor) -> torch.Tensor | None:
        """logits [B, C, V] of `seqs`' front canvases, masked in place for the constrained rows; each
        such canvas's best valid path under them kept on the device for `final` (so a canvas ends on
        the path of the logits its sampler read, before any temperature) and the rules' pins applied
        (`constraint_rules`). -> [B] bool on the device: the canvases the rules pinned at every
        position, which end in this step (`constraint_rules.pinned_whole`); None when no rule pins.
        Nothing is read back: the step's one sync stays the sampler's."""
        if not self.rows:  # called for every row group of every step: nothing to do without schemas
            return None
        rows_of = self.rows
        at = [
            (b, s, row)
            for b, s in enumerate(seqs)
            if (row := rows_of.get(s.row)) is not None and row.banned is not None
        ]
        if not at:
            return None
        t0 = time.perf_counter()
        for *_, row in at:
            row.steps += 1
        plans = self.table.ids([row for *_, row in at]) if self._fused(logits) else None
        rows, slots = self._step_rows(at, plans)
        if rows.plan is not None:  # bans, the opening's pin, log-sum-exps and argmax in one launch
            lse, argmax = self._constrain(logits, rows)
        else:
            lse, argmax = None, self._ban_and_open(at, logits, rows)
        try:
            toks, ends = self._best(at, logits, rows, lse)
        except Unfinishable as exc:  # begin's plan said otherwise: a bug, the rows end in error
            for _, s, _ in at:
                s.error, s.done = f"{UNFINISHABLE}: {exc}", True
            return None
        # only the settle rules pin a whole canvas: no buffer launched without them
        settles = self.settle is not None or self.max_steps is not None
        ended = torch.zeros(len(seqs), dtype=torch.bool, device=logits.device) if settles else None
        pins = step_rules(
            self.slots, rows, toks, ends, argmax, self.opens(), self.open_hold, self.settle,
            self.settle_positions, self.max_steps, kernel=self._fused(logits), ended=ended,
        )  # fmt: skip
        if pins is not None:
            pin(logits, rows.b, pins)
        self._host_us[slots] += 1e6 * (time.perf_counter() - t0) / len(at)  # `account` adds it to the rows
        return ended

    def _fused(self, logits: torch.Tensor) -> bool:
        """Whether the step masks and runs its rules through the kernels (CUDA by default; `self.kernels`
        forces it)."""
        return self.kernels if self.kernels is not None else logits.is_cuda

    def _constrain(self, logits: torch.Tensor, rows: StepRows) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`_ban_and_open` in one launch (`kernels.constrain`), plus the rows' log-sum-exps for the
        Viterbi: ([R, C] log-sum-exps, [R, C] argmax when the open rule reads it)."""
        from canvasq.kernels.constrain import constrain  # imported here: kernels' import fixes interpretation

        assert rows.plan is not None
        opened = self.slots.opened if self.open_hold is not None else None
        lse, argmax = constrain(
            logits, rows.b, rows.plan, self.table.plans, rows.slot, opened, NEG, rows.fresh
        )
        return lse, argmax if self.open_hold is not None else None

    def _ban_and_open(
        self, at: list[tuple[int, Seq, RowGrammar]], logits: torch.Tensor, rows: StepRows
    ) -> torch.Tensor | None:
        """The rows' bans (`_ban`) and, with the open rule, earlier steps' openings pinned before the
        Viterbi; the rows' argmax after both when the open rule reads it."""
        self._ban(at, logits, rows.b)
        if self.open_hold is None:
            return None
        opened = self.slots.opened[rows.slot]
        before = torch.full((len(at), self.C), -1, dtype=torch.long, device=logits.device)
        pin(logits, rows.b, before.scatter_(1, opened[:, :1].clamp(min=0), opened[:, 1:]))
        return logits.argmax(dim=-1)[rows.b]  # the group's argmax, then the rows': no [R, C, V] copy

    def _ban(self, at: list[tuple[int, Seq, RowGrammar]], logits: torch.Tensor, b: torch.Tensor) -> None:
        """Every constrained row's logits outside its masks set to `NEG`, in place: as one select over
        the rows when their [R, C, V] masks are small (the testbed's: a few launches, not one a row),
        else row by row (the real vocabulary's: no [R, C, V] copy)."""
        banned = [row.banned for *_, row in at if row.banned is not None]  # `at`: only planned rows
        if len(at) * banned[0].numel() <= BAN_STACK_ELEMENTS:
            logits[b] = logits[b].masked_fill_(torch.stack(banned), NEG)
            return
        for (k, _, _), mask in zip(at, banned):
            logits[k].masked_fill_(mask, NEG)

    def _step_rows(
        self, at: list[tuple[int, Seq, RowGrammar]], plans: list[int] | None
    ) -> tuple[StepRows, np.ndarray]:
        """The step's constrained rows (with their plans' places in `self.table` when given) as one
        host-to-device copy of int32 columns, and their slots. The slots whose canvas began since
        their last masked step are reset here when there are no plans (the torch masks and rules
        read their state); otherwise the kernels read them as fresh (`StepRows.fresh`) and nothing is
        launched for them. Tuples a row, because per-slot columns gathered with numpy cost more on an
        H200's host (0.13 against 0.09 ms a step, BENCHMARKS.md)."""
        host = [
            (
                b,
                s.slot,
                row.grammar.start,
                int(bool(s.req.think)),
                int(row.state == row.grammar.start),
                row.steps,
                plans[k] if plans is not None else -1,
                row.state,
                row.back if row.back is not None else self._place_back(s, row),
                int(s.slot in self._fresh),
            )
            for k, (b, s, row) in enumerate(at)
        ]
        # transposed on the host: each field a contiguous [R] column once copied (numpy makes the array
        # from the tuples in under half torch.tensor's time)
        array = np.array(host, dtype=np.int32).T.copy()
        slots = array[1]
        self.slots.grow(int(slots.max()))
        if len(self._host_us) < self.slots.S:  # as many slots as the rules' state holds
            self._host_us = np.concatenate([self._host_us, np.zeros(self.slots.S - len(self._host_us))])
        if plans is None:
            self.slots.reset([s.slot for _, s, _ in at if s.slot in self._fresh])
        self._fresh.difference_update(s.slot for _, s, _ in at)
        cols = to_device(torch.from_numpy(array), self.device)
        b, slot, start, think, at_start, steps, plan, state, back, fresh = cols.unbind(0)
        return StepRows(
            b, slot, start, think, at_start, steps, plan if plans is not None else None, state, back,
            fresh if plans is not None else None,
        ), slots  # fmt: skip

    def account(self, s: Seq) -> None:
        """The step hooks' host time on the row's slot (kept per slot by `mask`) added to its
        `stats["constraint_host_us"]`: the row is finished, its slot free for the next."""
        if s.slot < len(self._host_us) and self._host_us[s.slot]:
            s.stats["constraint_host_us"] += int(self._host_us[s.slot])
            self._host_us[s.slot] = 0.0

    def _budget(self, s: Seq) -> int:
        """The answer tokens left from the row's front canvas's first position."""
        return s.req.max_tokens - s.canvases[0].index * self.C

    def _place_back(self, s: Seq, row: RowGrammar) -> int:
        """The row's canvas budget placed in its grammar's table of backward sets (`begin` does it for
        every canvas; a row set up by hand has none)."""
        row.back = device_grammar(row.grammar, self.device).back_index(self.C, self._budget(s))
        return row.back

    def _best(
        self,
        rows: list[tuple[int, Seq, RowGrammar]],
        logits: torch.Tensor,
        cols: StepRows,
        lse: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's best completable path under its logits (`logits[cols.b]` [R, C, V], in `rows`'
        order; `lse` [R, C] their log-sum-exps when known) and the state it ends in ([R, C], [R] on the
        device): one batched device Viterbi per distinct grammar."""
        first = rows[0][2].grammar
        if all(row.grammar is first for *_, row in rows):  # the common case: one schema in the group
            return self._best_of(rows, logits, range(len(rows)), cols, lse)
        groups: dict[int, list[int]] = {}
        for k, (*_, row) in enumerate(rows):
            groups.setdefault(id(row.grammar), []).append(k)
        toks = torch.empty(len(rows), self.C, dtype=torch.long, device=logits.device)
        ends = torch.empty(len(rows), dtype=torch.long, device=logits.device)
        for ks in groups.values():
            at = to_device(ks, logits.device)
            part = cols.take(at)
            toks[at], ends[at] = self._best_of(rows, logits, ks, part, None if lse is None else lse[at])
        return toks, ends

    def _best_of(
        self, rows, logits: torch.Tensor, ks: Sequence[int], cols: StepRows, lse: torch.Tensor | None
    ):
        dg = device_grammar(rows[ks[0]][2].grammar, self.device)
        placed = logits.is_cuda and logits.dtype != torch.float64
        if placed and cols.state is not None and cols.back is not None:  # nothing to build or copy
            return dg.best_placed(cols.state, logits, cols.b, cols.back, lse)
        budgets = [self._budget(rows[k][1]) for k in ks]
        states = [rows[k][2].state for k in ks]
        return dg.best(states, logits, budgets, cols.b, lse)

    def final(self, finished: list[Seq], argmax: torch.Tensor) -> list[list[int]]:
        """The stopped canvases' tokens: their argmax ([F, C] on the device), the constrained rows'
        replaced by their best completable path under their last logits (found by `mask` this step),
        both read in one host read after the step's sync; the rules' counters added to the rows' stats."""
        at = [(k, s, self.rows[s.row]) for k, s in enumerate(finished) if s.row in self.rows]
        if not at:
            return argmax.tolist()
        out, read = self.slots.read_with(argmax, [s.slot for _, s, _ in at])
        tokens = list(out)
        for (k, s, row), (best, end, counts) in zip(at, read):
            assert row.steps > 0, "a constrained canvas ends only after a masked step"
            row.state = end
            s.stats["constrained_canvases"] += 1
            s.stats["constrained_changed"] += sum(a != b for a, b in zip(best, tokens[k]))
            for name, n in zip(COUNTERS, counts):
                if n:
                    s.stats[name] += n
            out[k] = best
        return out

    def best_of(self, s: Seq) -> tuple[list[int], int]:
        """The row's canvas's best valid path at its last masked step and its end state (a host read:
        for tests and traces)."""
        best, end, _ = self.slots.read([s.slot])[0]
        return best, end

    def counters(self, s: Seq) -> dict[str, int]:
        """The rules' counters of the row's current canvas (a host read: for tests and traces)."""
        return dict(zip(COUNTERS, self.slots.read([s.slot])[0][2]))

    def _check(self, row: RowGrammar | None, schema: dict) -> Callable[[str], str | None]:
        """The schema's `output_problem`, kept per grammar (a row's schema is a dict of its own line:
        keying the check by its JSON costs more than the check)."""
        if row is None:
            return functools.partial(output_problem, schema=schema)
        check = self._checks.get(row.grammar)
        if check is None:
            check = self._checks[row.grammar] = schema_check(json.dumps(schema, sort_keys=True))
        return check

    def _thought_tokens(self, ids: list[int]) -> int:
        """How many of `ids` come before the document: up to the first that opens it (`opens_document`)."""
        opens = self._opens_host()
        return next((i for i, t in enumerate(ids) if t < len(opens) and opens[t]), len(ids))

    def checked(self, s: Seq, res: DecodeResult) -> DecodeResult:
        """`res` of a finished row; a constrained one validated against its schema."""
        row = self.rows.pop(s.row, None)
        schema = s.req.response_format
        if schema is None:
            return res
        if res.error is not None:
            if res.error.startswith(UNFINISHABLE):
                res.error_code = UNFINISHABLE
            return res
        if s.req.think:  # the row's text is its document; its thought is kept beside it
            res.reasoning, res.text = split_thought(res.text)
            res.reasoning_tokens = self._thought_tokens(res.token_ids)
        problem = self._check(row, schema)(res.text)
        if problem is not None or res.finish_reason != FinishReason.stop:
            res.error = f"{INVALID}: {problem or 'the document did not end'}"
            res.error_code, res.finish_reason = INVALID, FinishReason.error
        return res
