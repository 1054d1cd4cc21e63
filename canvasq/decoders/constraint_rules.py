"""The pinning rules of `constrained.CanvasConstraints` (settle, settle_positions, max_steps,
open_hold) on the device, for a whole row group at once, with nothing read back mid-step.

Each rule keeps state per front canvas: the best valid path of its last step and how many steps each
of its positions has held, the path frozen at the step cap, where the model's argmax opened a
thinking row's document and for how long. Here that state is a set of tensors indexed by decoder
slot (`SlotRules`), and each step's rules (`step_rules`) run on the device: the paths the Viterbi
found never come to the host before the sampler reads the logits. On CUDA they are one launch
(`kernels.rules`: a testbed step on a GPU is bound by its launches); elsewhere, and as that kernel's
reference, where-selects over [rows, C] (`open_rule`, `settle_rule`). Read per row
and in Python, they cost a host sync in the middle of every constrained step (the host then waits
for the forward before it can queue the sampler, where a free step queues both and waits once) and
a loop over rows.

The host reads the state only where it needs it: the best path and end state of the canvases that
stopped (`SlotRules.read`, after the step's own sync) and the rules' counters then.

Pins are (row, position) -> token ([R, C], -1: none); `pin` makes those positions' logits one-hot
(that token 0, every other `NEG`) without a host read: on CUDA one Triton program per pinned
position (`kernels.pin`), elsewhere a select over the rows' logits.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from canvasq.model.windows import to_device

NEG = -1.0e9  # a masked logit: no probability, finite through temperature and entropy arithmetic
# the rules' counters per slot (each row's `stats`, added when its canvas stops)
COUNTERS = ("constraint_pinned_steps", "constraint_capped_steps", "constraint_pinned_positions")


@dataclass
class StepRows:
    """One step's constrained rows, as [R] int32 device columns (R rows of the group's logits), made by
    one host-to-device copy: the kernels read them as they are (a cast a column would be a launch)."""

    b: torch.Tensor  # rows in the group's logits
    slot: torch.Tensor  # decoder slots
    start: torch.Tensor  # each row's grammar start state
    think: torch.Tensor  # 1: the row writes a thought before its document
    at_start: torch.Tensor  # 1: the canvas starts in the grammar's start state (no document yet)
    steps: torch.Tensor  # masked steps of the row's canvas, this one included
    plan: torch.Tensor | None = None  # each row's plan in `constrained.PlanTable` (fused masking)
    state: torch.Tensor | None = None  # the automaton state the canvas starts in (the Viterbi's start)
    back: torch.Tensor | None = None  # its budget's place in the grammar's table of backward sets
    # 1: the canvas began since its slot's last masked step; the kernels read that slot's rule state as
    # a fresh canvas's (`SlotRules.reset` without its launches). None: the slots were reset.
    fresh: torch.Tensor | None = None

    def take(self, at: torch.Tensor) -> StepRows:
        """The rows `at` of these (every column indexed)."""
        return replace(
            self,
            **{f.name: getattr(self, f.name)[at] for f in fields(self) if getattr(self, f.name) is not None},
        )


# the rules' per-slot state: name -> (shape after the slot dimension, with C for the canvas; dtype; the
# value of a fresh canvas)
FIELDS: dict[str, tuple[tuple, torch.dtype, int]] = {
    "path": (("C",), torch.long, -1),  # the last step's best valid path
    "has_path": ((), torch.bool, 0),
    "held": (("C",), torch.int32, 0),  # steps each position's token on that path has held
    "frozen": ((), torch.bool, 0),  # pinned at the step cap
    "frozen_path": (("C",), torch.long, 0),
    "frozen_end": ((), torch.long, 0),
    "opening": ((3,), torch.long, -1),  # (position, token, steps held) of the argmax's opening token
    "opened": ((2,), torch.long, -1),  # (position, token) pinned from every later step's start
}
# what the host reads of a stopped canvas, as views of one [S, C + 1 + len(COUNTERS)] int64 table
# (`SlotRules.out`), so its read is one copy: this step's best valid path (a frozen canvas's: its
# frozen one), the state it ends in, the rules' counters
OUT_FIELDS = ("best", "best_end", "counts")
# the most bytes of `out` read whole; a larger table is gathered at the slots read first
OUT_READ_BYTES = 1 << 18


class SlotRules:
    """The rules' per-slot state ([S, ...] device tensors, `FIELDS`, grown as slots appear)."""

    path: torch.Tensor
    has_path: torch.Tensor
    held: torch.Tensor
    frozen: torch.Tensor
    frozen_path: torch.Tensor
    frozen_end: torch.Tensor
    opening: torch.Tensor
    opened: torch.Tensor
    out: torch.Tensor  # [S, C + 1 + len(COUNTERS)] int64: `best`, `best_end` and `counts` (views of it)
    best: torch.Tensor
    best_end: torch.Tensor
    counts: torch.Tensor

    def __init__(self, C: int, device: torch.device):
        self.C, self.device, self.S = C, device, 0
        self._alloc(0)

    def _alloc(self, S: int) -> None:
        """Every field at S slots, the first `self.S` slots' state kept."""
        for name, (tail, dtype, fill) in FIELDS.items():
            shape = (S, *(self.C if d == "C" else d for d in tail))
            t = torch.full(shape, fill, dtype=dtype, device=self.device)
            if self.S:
                t[: self.S] = getattr(self, name)
            setattr(self, name, t)
        out = torch.zeros(S, self.C + 1 + len(COUNTERS), dtype=torch.long, device=self.device)
        if self.S:
            out[: self.S] = self.out
        self.out, self.S = out, S
        self.best, self.best_end, self.counts = out[:, : self.C], out[:, self.C], out[:, self.C + 1 :]

    def grow(self, slot: int) -> None:
        """Room for `slot` (a new slot's state is a fresh canvas's)."""
        if slot >= self.S:
            self._alloc(max(slot + 1, 2 * self.S))

    def reset(self, slots: list[int]) -> None:
        """The slots' new canvases: nothing held, frozen, opened or counted."""
        if not slots:
            return
        self.grow(max(slots))
        idx = to_device(slots, self.device)
        for name in ("has_path", "held", "frozen", "opening", "opened"):
            getattr(self, name).index_fill_(0, idx, FIELDS[name][2])  # a scalar fill: no stream sync
        self.counts.index_fill_(0, idx, 0)

    def read(self, slots: list[int]) -> list[tuple[list[int], int, list[int]]]:
        """Per slot: its canvas's best valid path at the last step, the state it ends in and the rules'
        counters (one host read)."""
        return self.read_with(None, slots)[1]

    def read_with(
        self, head: torch.Tensor | None, slots: list[int]
    ) -> tuple[list[list[int]], list[tuple[list[int], int, list[int]]]]:
        """`read(slots)` and the rows of `head` (a [F, C] device tensor, e.g. the stopped canvases'
        argmax) in the same host read: one sync where there were two. The slots' rows of `out` are
        read with the whole table where it is small (`OUT_READ_BYTES`: a copy, where a gather would
        first copy the slots to the device and launch), else gathered."""
        whole = self.out.numel() * 8 <= OUT_READ_BYTES
        table = self.out if whole else self.out[to_device(slots, self.device)]
        both = (
            table.reshape(-1)
            if head is None
            else torch.cat([head.reshape(-1).to(table.dtype), table.reshape(-1)])
        )
        flat = both.cpu().numpy()
        cut = 0 if head is None else head.numel()
        rows = flat[cut:].reshape(-1, self.out.shape[1])
        picked = (rows[slots] if whole else rows).tolist()
        C = self.C
        return flat[:cut].reshape(-1, C).tolist(), [(r[:C], r[C], r[C + 1 :]) for r in picked]


def opens_document(text: str | None) -> bool:
    """Whether a token's text opens the document: a "{" or "[" in it (no token of a thought has one,
    `structured.THINK`)."""
    return text is not None and ("{" in text or "[" in text)


def first_opening(ids: torch.Tensor, opens: torch.Tensor) -> torch.Tensor:
    """[R, C] token ids -> [R]: the first position whose token opens the document (`opens` [V] bool:
    a "{" or "[" in its text), C where none does."""
    hit = opens[ids]
    return torch.where(hit.any(dim=-1), hit.int().argmax(dim=-1), ids.shape[1])


def step_rules(
    st: SlotRules,
    rows: StepRows,
    toks: torch.Tensor,
    ends: torch.Tensor,
    argmax: torch.Tensor | None,
    opens: torch.Tensor,
    hold: int | None,
    settle: int | None,
    positions: int | None,
    max_steps: int | None,
    kernel: bool | None = None,
    ended: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """One step's rules for the rows' best valid paths `toks` [R, C] ending in `ends` [R]: the best
    paths kept (`st.best`), then the open rule (with `hold`; `argmax` [R, C] the model's) and the
    settle rules (with `settle` or `max_steps`) -> [R, C] pins, the settle rules' over the open
    rule's; None when no rule is on. `ended` ([B] bool, the group's rows, all False), if given: set
    at `rows.b` for the canvases pinned at every position (`pinned_whole`). `kernel` (default: on
    CUDA): all of it in one launch (`kernels.rules`) instead of the torch rules' some 80 small selects."""
    settles = settle is not None or max_steps is not None
    if kernel if kernel is not None else toks.is_cuda:
        from canvasq.kernels.rules import rules  # imported here: kernels' import fixes interpretation

        fused = rules(st, rows, toks, ends, argmax, opens, hold, settle, positions, max_steps, ended)
        return fused if hold is not None or settles else None
    st.best[rows.slot], st.best_end[rows.slot] = toks, ends
    pins: torch.Tensor | None = None
    if hold is not None:
        assert argmax is not None, "the open rule reads the model's argmax"
        pins = open_rule(st, rows, ends, argmax, opens, hold)
    if settles:
        capped = (
            rows.steps >= max_steps
            if max_steps is not None
            else torch.zeros_like(rows.steps, dtype=torch.bool)
        )
        settled = settle_rule(st, rows, toks, ends, capped, settle, positions, opens)
        pins = settled if pins is None else torch.where(settled >= 0, settled, pins)
    if ended is not None and pins is not None:
        ended[rows.b.long()] = pinned_whole(pins)
    return pins


def pinned_whole(pins: torch.Tensor) -> torch.Tensor:
    """[R, C] pins -> [R] bool: the canvases pinned at every position. Their logits are one-hot on
    their best valid path, so the sampler's argmax is that path and it is what `final` takes: such a
    canvas ends in this step (`OfficialDecoder.step`), where the stability rule would end it a step
    later (its argmax has to repeat) on the same tokens, at a forward a canvas."""
    return (pins >= 0).all(dim=-1)


def open_rule(
    st: SlotRules, rows: StepRows, ends: torch.Tensor, argmax: torch.Tensor, opens: torch.Tensor, hold: int
) -> torch.Tensor:
    """The open rule (`OfficialConfig.constraint_open_hold`): a thinking row whose best valid path is
    still all thought (`ends` == its start) while the model's own argmax [R, C] opens the document
    (its first token with a "{" or "[") has that token pinned there once it has held its position
    for `hold` steps: this step, and (`CanvasConstraints.mask`) from every later step's start, so the
    path must begin the document where the model does. Without it the path keeps the thought
    whenever the model's first document tokens are slightly off (a key misspelt): the thought's free
    text takes them, the canvas runs to the step cap, and the next canvas goes on from that text (2 %
    of a seed's rows, a tenth of its forwards). The masks allow the token there only if a valid
    document can follow within the budget, so the path stays completable. -> [R, C] pins (the token
    at its position for the rows opened this step, -1 elsewhere)."""
    C, sl = st.C, rows.slot
    eligible = rows.think.bool() & rows.at_start.bool() & (st.opened[sl, 0] < 0) & (ends == rows.start)
    c = first_opening(argmax, opens)
    found = c < C
    tok = argmax.gather(1, c.clamp(max=C - 1)[:, None])[:, 0]
    prev = st.opening[sl]
    same = (prev[:, 0] == c) & (prev[:, 1] == tok) & found
    held = torch.where(same, prev[:, 2] + 1, 0)
    now = torch.stack([c, tok, held], dim=1)
    none = torch.full_like(now, -1)
    st.opening[sl] = torch.where(eligible[:, None], torch.where(found[:, None], now, none), prev)
    opened = eligible & found & (held >= hold)
    st.opened[sl] = torch.where(opened[:, None], now[:, :2], st.opened[sl])
    pins = torch.full((len(sl), C), -1, dtype=torch.long, device=argmax.device)
    return pins.scatter_(1, c.clamp(max=C - 1)[:, None], torch.where(opened, tok, -1)[:, None])


def settle_rule(
    st: SlotRules,
    rows: StepRows,
    toks: torch.Tensor,
    ends: torch.Tensor,
    capped: torch.Tensor,
    settle: int | None,
    positions: int | None,
    opens: torch.Tensor,
) -> torch.Tensor:
    """The settle rules, for the rows' best valid paths `toks` [R, C] ending in `ends` [R]: a canvas
    whose path has held for `settle` steps is pinned to it whole (one-hot logits: the argmax is the
    path, every entropy 0; the canvas ends in this step, `pinned_whole`). With `positions`
    (`constraint_settle_positions`), the document's positions whose tokens on the path have held that
    many steps are pinned from its start up to the first that has not (`held_prefix`; the thought
    before the document never is): an array's length or an enum the model stays unsure of would
    otherwise keep the canvas to the step cap. With `capped` [R] (the canvas's `max_steps`-th step or
    later), a canvas with a document on its path is pinned whole, held or not, and to that same path
    on every step after (a path re-read each step could move and keep it going). A canvas whose path is
    thought only is left to the sampler's own rule, and nothing holds across such a step. A pinned
    token is the path's, so the path stays the best valid one under the pinned logits. The paths and
    held counts advance, the canvases' best paths are written (a frozen canvas's: its frozen path)
    -> [R, C] pins."""
    sl = rows.slot
    frozen = st.frozen[sl]
    thought = rows.think.bool() & (ends == rows.start)  # all thought: the sampler's own rule ends it
    live = ~frozen & ~thought  # the rows whose path this step counts
    same = (toks == st.path[sl]) & st.has_path[sl, None]
    held = torch.where(same, st.held[sl] + 1, 0)
    st.held[sl] = torch.where(
        live[:, None], held, torch.where(thought[:, None] & ~frozen[:, None], 0, st.held[sl])
    )
    st.path[sl] = torch.where(live[:, None], toks, st.path[sl])
    st.has_path[sl] = torch.where(frozen, st.has_path[sl], live)
    cap = live & capped
    settled = live & ~cap & (held.min(dim=-1).values >= settle if settle is not None else False)
    st.frozen[sl] = frozen | cap
    st.frozen_path[sl] = torch.where(cap[:, None], toks, st.frozen_path[sl])
    st.frozen_end[sl] = torch.where(cap, ends, st.frozen_end[sl])
    path = torch.where(frozen[:, None], st.frozen_path[sl], toks)
    st.best[sl], st.best_end[sl] = path, torch.where(frozen, st.frozen_end[sl], ends)
    whole = frozen | cap | settled
    pins = torch.where(whole[:, None], path, -1)
    counted = [settled, cap, torch.zeros_like(cap, dtype=torch.long)]
    if positions is not None:
        prefix = held_prefix(rows, toks, held, positions, opens) & (live & ~cap & ~settled)[:, None]
        pins = torch.where(prefix, toks, pins)
        counted[2] = prefix.sum(dim=-1)
    st.counts[sl] += torch.stack([x.long() for x in counted], dim=1)
    return pins


def held_prefix(
    rows: StepRows, toks: torch.Tensor, held: torch.Tensor, positions: int, opens: torch.Tensor
) -> torch.Tensor:
    """[R, C] bool: per row, the document's positions (after its thought, in a canvas that starts it)
    up to the first whose token has held fewer than `positions` steps: a document is pinned from its
    start, so a value it has not settled (an array's length, the element that ends it) stays open,
    and so does all that comes after it."""
    C = toks.shape[1]
    first = torch.where(rows.at_start.bool(), first_opening(toks, opens), 0)
    col = torch.arange(C, device=toks.device)[None, :]
    before = col < first[:, None]
    ok = (held >= positions) | before
    return ~before & (ok.int().cumprod(dim=-1) == 1)


def pin(logits: torch.Tensor, b: torch.Tensor, pins: torch.Tensor) -> None:
    """Rows `b` [R] of logits [B, C, V]: each position with a pin (`pins` [R, C], -1: none) made
    one-hot on its token (0; every other token `NEG`), in place, with no host read."""
    if logits.is_cuda:
        from canvasq.kernels.pin import pin_positions  # imported here: kernels' import fixes interpretation

        pin_positions(logits, b, pins, NEG)
    else:
        pin_torch(logits, b, pins)


def pin_torch(logits: torch.Tensor, b: torch.Tensor, pins: torch.Tensor) -> None:
    """`pin` in torch: a select over the rows' whole logits (the kernel's reference)."""
    x = logits[b]
    hot = torch.full_like(x, NEG).scatter_(2, pins.clamp(min=0)[..., None], 0.0)
    logits[b] = torch.where((pins >= 0)[..., None], hot, x)
