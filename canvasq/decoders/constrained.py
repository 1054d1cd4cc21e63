"""`official`'s structured output: the rows with a `response_format` schema held to it, canvas by canvas
(`decoders.structured` has the method). The decoder calls four hooks:

- `begin(s, cv)` when a row's canvas is spawned: the canvas's token masks from the automaton state its
  committed answer reached and the answer tokens left (`Grammar.plan`, built on the device);
- `mask(seqs, logits)` after each decoder forward: every constrained row's logits outside its masks set
  to `NEG` in place, so the sampler's draws, argmax, entropies (the acceptance and stopping rules) and
  self-conditioning all see only tokens some valid completion allows (scaffold positions have one
  token: entropy 0, accepted at the first step); with `settle` (OfficialConfig.constraint_settle), a
  canvas whose best valid path has held that many steps is pinned to it (`_settle`; with `think`, not
  a canvas whose path is thought only: official's own rule ends those, as it ends free text), and with
  `settle_positions` the document's positions whose tokens on that path have held that long are
  pinned from its start, before the whole path holds (an array's length or an enum the model stays
  unsure of would otherwise keep the canvas to the step cap); with `open_hold`, a thinking row's
  document starts where the model's argmax has held its opening brace (`_open`);
- `final(finished, tokens)` when canvases stop: a constrained row's tokens are the best completable
  path under its last logits (`Grammar.best`, on the device, found by `mask` in the same step), not
  the per-position argmax;
- `checked(s, result)` for every finished row: its text parsed and validated against the schema
  (jsonschema); a row that fails is an error with code `invalid_structured_output` (it cannot happen
  by construction; the check makes sure), never a done row with invalid JSON.

Each row's `stats["constraint_host_us"]` sums the host time these hooks spent on it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from canvasq.decoders.grammar_device import device_grammar
from canvasq.decoders.state import Canvas, Seq, to_device
from canvasq.decoders.structured import (
    Grammar,
    TokenTexts,
    Unfinishable,
    cached_grammar,
    output_problem,
    split_thought,
    token_texts,
)
from canvasq.decoders.types import DecodeResult, FinishReason

NEG = -1.0e9  # a masked logit: no probability, finite through temperature and entropy arithmetic
UNFINISHABLE = "structured_output_unfinishable"
INVALID = "invalid_structured_output"


@dataclass
class RowGrammar:
    grammar: Grammar
    state: int  # the automaton's state after the committed answer
    banned: torch.Tensor | None = None  # [C, V] bool on the device: the front canvas's banned tokens
    path: list[int] | None = None  # the front canvas's best valid path at the last step
    # per position: steps its token on that path has not changed (the whole path's: their minimum)
    held: list[int] | None = None
    steps: int = 0  # the front canvas's masked steps
    frozen: tuple[list[int], int] | None = None  # the path (and end state) pinned at `max_steps`
    best: tuple[list[int], int] | None = None  # this step's best valid path and the state it ends in
    # thinking: where the model's argmax opened the document on the last step, and for how many steps
    # ((position, token), held); then `opened`, that token pinned there from every later step's start
    opening: tuple[tuple[int, int], int] | None = None
    opened: tuple[int, int] | None = None


def bundle_texts(bundle) -> TokenTexts:
    """The bundle's token texts (its directory's `tokenizer.json`; the testbed's for random weights)."""
    from canvasq.model.loading import DEFAULT_MODEL_DIR

    path = Path(bundle.spec) / "tokenizer.json"
    if not path.is_file():
        path = DEFAULT_MODEL_DIR / "tokenizer.json"
    return token_texts(str(path), bundle.eos_id, bundle.pad_id)


class CanvasConstraints:
    """Per-row automata of one decoder's stream (keyed by `Seq.row`)."""

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
        self.rows: dict[int, RowGrammar] = {}

    def texts(self) -> TokenTexts:
        if self._texts is None:
            self._texts = bundle_texts(self.bundle)
        return self._texts

    def reset(self) -> None:
        self.rows = {}

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
        try:
            row.banned = device_grammar(row.grammar, self.device).banned(row.state, self.C, budget, self.V)
        except Unfinishable as exc:
            s.error, s.done = f"{UNFINISHABLE}: {exc}", True
            return
        row.path, row.held, row.best, row.steps, row.frozen = None, None, None, 0, None
        row.opening, row.opened = None, None
        s.stats["constraint_host_us"] += int(1e6 * (time.perf_counter() - t0))

    def mask(self, seqs: list[Seq], logits: torch.Tensor) -> None:
        """logits [B, C, V] of `seqs`' front canvases, masked in place for the constrained rows; each
        such canvas's best valid path under them kept for `final` (so a canvas ends on the path of the
        logits its sampler read, before any temperature) and, with `settle`, the settled canvases and
        document prefixes pinned to it."""
        if not self.rows:  # called for every row group of every step: nothing to do without schemas
            return
        at = [(b, s, self.rows[s.row]) for b, s in enumerate(seqs) if s.row in self.rows]
        at = [(b, s, row) for b, s, row in at if row.banned is not None]
        if not at:
            return
        t0 = time.perf_counter()
        idx = to_device([b for b, _, _ in at], logits.device)
        for b, _, row in at:  # in place, row by row: no [R, C, V] gather, copy and scatter back
            assert row.banned is not None  # `at` keeps only planned rows
            logits[b].masked_fill_(row.banned, NEG)
        _pin(logits, [(b, *row.opened) for b, _, row in at if row.opened is not None])
        try:
            paths = self._best([(s, row) for _, s, row in at], logits, idx)
        except Unfinishable as exc:  # begin's plan said otherwise: a bug, the rows end in error
            for _, s, _ in at:
                s.error, s.done = f"{UNFINISHABLE}: {exc}", True
            return
        for (_, _, row), best in zip(at, paths):
            row.best = best
        if self.open_hold is not None:
            self._open(at, paths, logits)
        if self.settle is not None or self.max_steps is not None:
            self._settle(at, paths, logits)
        share = int(1e6 * (time.perf_counter() - t0) / len(at))
        for _, s, _ in at:
            s.stats["constraint_host_us"] += share

    def _settle(
        self, at: list[tuple[int, Seq, RowGrammar]], paths: list[tuple[list[int], int]], logits: torch.Tensor
    ) -> None:
        """Pin each canvas (its row of logits [B, C, V], masked) to its best valid path (`paths`, found
        on the device by `grammar_device`) once that path has held for `settle` steps: one-hot logits,
        so the argmax is the path, every entropy 0 and the stopping rule ends the canvas at its next
        check. With `settle_positions`, the document's positions whose tokens on the path have held
        that many steps are pinned from its start up to the first that has not (`_held_prefix`; the
        thought before the document never is). With `max_steps`, a canvas with a document on its path
        is pinned whole at its `max_steps`-th step, held or not, and to that same path on every step
        after (it ends on it; a path re-read each step could move and keep it going). A pinned token
        is the path's, so the path stays the best valid one under the pinned logits."""
        pins: list[tuple[int, int, int]] = []  # (row in logits, position, token)
        for (b, s, row), (path, end) in zip(at, paths):
            row.steps += 1
            if row.frozen is not None:
                row.best = row.frozen
                pins += [(b, c, t) for c, t in enumerate(row.frozen[0])]
                continue
            if s.req.think and end == row.grammar.start:  # all thought: the sampler's own rule ends it
                row.path, row.held = None, None  # and nothing holds across such a step
                continue
            same = [a == p for a, p in zip(path, row.path)] if row.path is not None else [False] * len(path)
            row.held = [h + 1 if eq else 0 for h, eq in zip(row.held or [0] * len(path), same)]
            row.path = path
            capped = self.max_steps is not None and row.steps >= self.max_steps
            if capped:
                row.frozen = (path, end)
            if capped or (self.settle is not None and min(row.held) >= self.settle):
                pins += [(b, c, t) for c, t in enumerate(path)]
                s.stats["constraint_capped_steps" if capped else "constraint_pinned_steps"] += 1
            elif self.settle_positions is not None:
                held = self._held_prefix(row, path)
                pins += [(b, c, path[c]) for c in held]
                s.stats["constraint_pinned_positions"] += len(held)
        _pin(logits, pins)

    def _open(
        self, at: list[tuple[int, Seq, RowGrammar]], paths: list[tuple[list[int], int]], logits: torch.Tensor
    ) -> None:
        """Thinking rows whose best valid path is still all thought while the model's own argmax opens
        the document (its first token with a "{" or "["): once that token has held its position for
        `open_hold` steps, it is pinned there, this step and (`mask`) from every later step's start, so
        the path must begin the document where the model does. Without it the path keeps the thought
        whenever the model's first document tokens are slightly off (a key misspelt): the thought's
        free text takes them, the canvas runs to the step cap, and the next canvas goes on from that
        text (2 % of a seed's rows, a tenth of its forwards). The masks allow the token there only if
        a valid document can follow within the budget, so the path stays completable."""
        rows = [
            (b, row)
            for (b, s, row), (_, end) in zip(at, paths)
            if s.req.think
            and row.opened is None
            and row.state == row.grammar.start
            and end == row.grammar.start
        ]
        if not rows:
            return
        hold = self.open_hold
        assert hold is not None  # `mask` calls this only with the rule on
        # the group's argmax, then the rows': [B, C] ids, never a gathered copy of their [C, V] logits
        argmax = logits.argmax(dim=-1)[to_device([b for b, _ in rows], logits.device)].tolist()
        pins = []
        for (b, row), ids in zip(rows, argmax):
            c = self._thought_tokens(ids)
            if c == len(ids):
                row.opening = None
                continue
            held = row.opening[1] + 1 if row.opening is not None and row.opening[0] == (c, ids[c]) else 0
            row.opening = ((c, ids[c]), held)
            if held >= hold:
                row.opened = (c, ids[c])
                pins.append((b, c, ids[c]))
        _pin(logits, pins)

    def _held_prefix(self, row: RowGrammar, path: list[int]) -> range:
        """The positions of the canvas's document (after its thought) up to the first whose token on the
        path has held fewer than `settle_positions` steps: a document is pinned from its start, so a
        value it has not settled (an array's length, the element that ends it) stays open, and so
        does all that comes after it."""
        assert self.settle_positions is not None and row.held is not None
        first = 0 if row.state != row.grammar.start else self._thought_tokens(path)
        end = first
        while end < len(path) and row.held[end] >= self.settle_positions:
            end += 1
        return range(first, end)

    def _best(
        self, rows: list[tuple[Seq, RowGrammar]], logits: torch.Tensor, idx: torch.Tensor
    ) -> list[tuple[list[int], int]]:
        """Each row's best completable path under its logits (`logits[idx]` [R, C, V], in `rows`' order)
        and the state it ends in: one batched device Viterbi per distinct grammar."""
        out: list[tuple[list[int], int]] = [([], 0)] * len(rows)
        groups: dict[int, list[int]] = {}
        for k, (_, row) in enumerate(rows):
            groups.setdefault(id(row.grammar), []).append(k)
        for ks in groups.values():
            grammar = rows[ks[0]][1].grammar
            budgets = [s.req.max_tokens - s.canvases[0].index * self.C for s, _ in (rows[k] for k in ks)]
            toks, ends = device_grammar(grammar, self.device).best(
                [rows[k][1].state for k in ks], logits, budgets, idx[to_device(ks, idx.device)]
            )
            for k, path, end in zip(ks, toks.tolist(), ends):
                out[k] = (path, end)
        return out

    def final(self, finished: list[Seq], tokens: list[list[int]]) -> list[list[int]]:
        """The stopped canvases' tokens, the constrained rows' replaced by their best completable path
        under their last logits (found by `mask` this step)."""
        out = list(tokens)
        for k, s in enumerate(finished):
            row = self.rows.get(s.row)
            if row is None:
                continue
            assert row.best is not None, "a constrained canvas ends only after a masked step"
            best, row.state = row.best
            s.stats["constrained_canvases"] += 1
            s.stats["constrained_changed"] += sum(a != b for a, b in zip(best, tokens[k]))
            out[k] = best
        return out

    def _thought_tokens(self, ids: list[int]) -> int:
        """How many of `ids` come before the document: up to the first token with a "{" or "[" (no
        token of the thought has one, `structured.THINK`)."""
        texts = self.texts().texts
        for i, t in enumerate(ids):
            text = texts[t] if t < len(texts) else None
            if text is not None and ("{" in text or "[" in text):
                return i
        return len(ids)

    def checked(self, s: Seq, res: DecodeResult) -> DecodeResult:
        """`res` of a finished row; a constrained one validated against its schema."""
        self.rows.pop(s.row, None)
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
        problem = output_problem(res.text, schema)
        if problem is not None or res.finish_reason != FinishReason.stop:
            res.error = f"{INVALID}: {problem or 'the document did not end'}"
            res.error_code, res.finish_reason = INVALID, FinishReason.error
        return res


def _pin(logits: torch.Tensor, pins: list[tuple[int, int, int]]) -> None:
    """(row, position, token) of logits [B, C, V] made one-hot: that token, every other masked."""
    if pins:
        b_t, c_t, t_t = to_device(pins, logits.device).unbind(1)
        logits[b_t, c_t] = NEG
        logits[b_t, c_t, t_t] = 0.0
