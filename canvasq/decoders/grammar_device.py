"""A schema's automaton on the decoder's device: the canvas masks (`Grammar.plan`) and the best
completable path (`Grammar.best`) for many rows at once, in torch, so a constrained canvas's logits
never leave the device.

At the testbed's vocabulary (748) the host versions cost ~11 % of a request's wall; at the real one
(262,144) they would copy [rows, C, V] fp32 log-probs to the host every step (64 rows × 256 × 262,144
× 4 bytes = 17 GB) and build each canvas's [C, V] mask there. Here the log-probs are read only at the
automaton's edges ([rows, E]), the Viterbi runs C steps of batched scatter-max over the edges, and
only the chosen tokens ([rows, C]) and end states come back.

Neither waits for the device: whether a state can still finish is read from the host's backward
sets, and nothing is copied back before the tokens. On a GPU a step's launches, not its arithmetic,
are the cost at the testbed's size (a plan that synchronised at each of its C positions took 5 ms), so
a canvas's masks are kept per (state, C, budget) (`PLAN_CACHE_BYTES`) and the edges' log-probs are
read for many positions at once (`GAIN_ELEMENTS` per read).

On CUDA the Viterbi is one Triton launch (`kernels.viterbi`); its torch twin here serves the CPU and
float64 (the tests' reference precision).

Same answers as `structured.Grammar`: the same masks, and the same path (ties to the highest edge
index, as `Grammar.best` breaks them); tests compare the two on random log-probs.
"""

from __future__ import annotations

from collections import OrderedDict
from functools import lru_cache

import numpy as np
import torch

from canvasq.decoders.structured import Grammar, Unfinishable
from canvasq.model.windows import to_device

# canvas masks kept per grammar and device (a real-shape [256, 262,144] mask: 64 MiB)
PLAN_CACHE_BYTES = 1 << 30
# the most [rows, positions, max(V, E)] elements one read of the edges' log-probs makes
GAIN_ELEMENTS = 1 << 25


class DeviceGrammar:
    """`grammar`'s edges as device tensors; the backward sets (which states can still finish) come
    from the host, once per (C, budget)."""

    def __init__(self, grammar: Grammar, device: torch.device):
        self.g, self.device = grammar, device
        self.src = torch.as_tensor(grammar.src, device=device)
        self.tok = torch.as_tensor(grammar.tok, device=device)
        self.dst = torch.as_tensor(grammar.dst, device=device)
        self.free = self.src == grammar.done  # the padding after the document's EOS scores nothing
        self.edge = torch.arange(len(grammar.src), device=device)
        self._plans: OrderedDict[tuple[int, int, int, int], torch.Tensor] = OrderedDict()
        self._plan_bytes = 0
        # the edges by the state they enter, in chunks, their free-text classes apart
        # (`kernels.viterbi.csr`; per chunk size, vocabulary and class size), built when the kernel first runs
        self._csr: dict[tuple[int | None, int, int | None], dict] = {}
        # per C: the backward sets of every budget met so far ([N, C + 1, Q] int8) and each budget's place
        self._backs: dict[int, tuple[torch.Tensor, dict[int, int]]] = {}

    def back(self, C: int, budget: int) -> torch.Tensor:
        """[C + 1, Q] bool: `Grammar._backward` on the device (cached per C and budget)."""
        return _back(self, C, budget)

    def back_index(self, C: int, budget: int) -> int:
        """The place of `back(C, budget)` in `backs(C)`, added on first use (when a canvas begins), so
        a step's Viterbi reads each row's by index, with no stack of R tensors a step."""
        table, index = self._backs.get(C, (None, {}))
        if budget not in index:
            new = self.back(C, budget).to(torch.int8)[None]
            table = new if table is None else torch.cat([table, new])
            index[budget] = len(index)
            self._backs[C] = (table, index)
        return index[budget]

    def backs(self, C: int) -> torch.Tensor:
        """[N, C + 1, Q] int8: the backward sets of the budgets `back_index` has placed."""
        return self._backs[C][0]

    def can_finish(self, state: int, C: int, budget: int) -> bool:
        """Whether a canvas of C positions starting in `state` can keep the document completable within
        `budget` tokens (the host's copy of `back`: no device read)."""
        return bool(_back_host(self.g, C, budget)[0][state])

    def plan(self, state: int, C: int, budget: int, V: int) -> torch.Tensor:
        """[C, V] bool: `Grammar.plan`'s masks, built on the device (tokens past the tokenizer's
        vocabulary stay False). A new tensor: the kept form is `banned`'s."""
        return ~self.banned(state, C, budget, V)

    def banned(self, state: int, C: int, budget: int, V: int) -> torch.Tensor:
        """[C, V] bool: the tokens `plan` does not allow (what a mask fills), kept per (state, C,
        budget, V) so a step masks without inverting [C, V] again: treat the result as read-only."""
        if not self.can_finish(state, C, budget):
            raise Unfinishable(f"the document cannot be finished within {budget} tokens")
        key = (state, C, budget, V)
        if (hit := self._plans.get(key)) is not None:
            self._plans.move_to_end(key)
            return hit
        banned = self._plan(state, C, budget, V)
        size = banned.numel()
        while self._plans and self._plan_bytes + size > PLAN_CACHE_BYTES:
            self._plan_bytes -= self._plans.popitem(last=False)[1].numel()
        if size <= PLAN_CACHE_BYTES:
            self._plans[key], self._plan_bytes = banned, self._plan_bytes + size
        return banned

    def _plan(self, state: int, C: int, budget: int, V: int) -> torch.Tensor:
        """The states each position can be reached in (C small steps over [Q]), then every position's
        allowed edges' tokens in one scatter, and the rest banned: no device read."""
        ok = self.back(C, budget)[1:, self.dst]  # [C, E]: the edge keeps the document completable
        here = torch.zeros(self.g.Q, dtype=torch.int32, device=self.device)
        here[state] = 1
        takes = []
        for i in range(C):
            take = here[self.src] * ok[i]
            takes.append(take)
            here = torch.zeros_like(here).scatter_add_(0, self.dst, take).clamp_(max=1)
        take_all = torch.stack(takes)  # [C, E]
        counts = torch.zeros(C, V, dtype=torch.int32, device=self.device)
        return counts.scatter_add_(1, self.tok.expand(C, -1), take_all) == 0

    def best(
        self,
        states: list[int],
        logits: torch.Tensor,
        budgets: list[int],
        rows: torch.Tensor | None = None,
        lse: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's best completable path from its state under its log-softmax of `logits` [B, C, V]
        (on the device; `rows`: the R rows of B to read, all by default; `lse` [R, C]: their
        log-sum-exps when the caller has them) within its budget: ([R, C] tokens, [R] end states, both
        on the device: nothing is read back). The edges' log-probs are read a few positions at a time
        (`GAIN_ELEMENTS`): no [R, C, V] copy is made."""
        rows = torch.arange(logits.shape[0], device=logits.device) if rows is None else rows
        C = logits.shape[1]
        if not all(self.can_finish(q, C, b) for q, b in zip(states, budgets)):
            raise Unfinishable("a canvas's document cannot be finished within its budget")
        back = torch.stack([self.back(C, b) for b in budgets])  # [R, C + 1, Q]
        # CUDA only: under TRITON_INTERPRET the kernel walks every block of every state in Python (minutes
        # at a 4,096-token vocabulary); tests/kernels/test_viterbi.py calls `_best_kernel` itself
        if logits.dtype != torch.float64 and logits.is_cuda:
            return self._best_kernel(states, logits, rows, back, lse=lse)
        return self._best_torch(states, logits, rows, back)

    def _best_torch(
        self, states: list[int], logits: torch.Tensor, rows: torch.Tensor, back: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`best`'s torch twin: each position a batched scatter-max over the edges."""
        R, C = len(rows), logits.shape[1]
        Q, E = self.g.Q, len(self.g.src)
        dtype = torch.promote_types(logits.dtype, torch.float32)
        score = torch.full((R, Q), float("-inf"), dtype=dtype, device=self.device)
        score[torch.arange(R, device=self.device), torch.as_tensor(states, device=self.device)] = 0.0
        dst = self.dst.expand(R, E)
        via = torch.empty(R, C, Q, dtype=torch.long, device=self.device)
        step = max(1, GAIN_ELEMENTS // max(1, R * max(E, logits.shape[2])))
        for i0 in range(0, C, step):
            gains = self._gains(logits, rows, back, i0, min(C, i0 + step), dtype)
            for j in range(gains.shape[1]):
                cand = score[:, self.src] + gains[:, j]
                score = torch.full_like(score, float("-inf")).scatter_reduce_(1, dst, cand, "amax")
                won = (cand == score.gather(1, dst)) & (cand > float("-inf"))
                via[:, i0 + j] = torch.full_like(score, -1, dtype=torch.long).scatter_reduce_(
                    1, dst, torch.where(won, self.edge, -1), "amax"
                )
        q = score.argmax(1)
        ends = q  # the walk back rebinds q: this tensor stays the end states
        toks = torch.empty(R, C, dtype=torch.long, device=self.device)
        for i in range(C - 1, -1, -1):
            e = via[:, i].gather(1, q[:, None])[:, 0]
            toks[:, i] = self.tok[e]
            q = self.src[e]
        return toks, ends

    def _best_kernel(
        self,
        states: list[int] | torch.Tensor,
        logits: torch.Tensor,
        rows: torch.Tensor,
        back: torch.Tensor,
        block: int | None = None,
        tile: int | None = None,
        lse: torch.Tensor | None = None,
        back_rows: torch.Tensor | None = None,
        class_min: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`best` in one launch (`kernels.viterbi`): the positions' log-sum-exps (`lse`, or in torch a
        few positions at a time), then one program per row. `states` may be an [R] device column, and
        `back` a table read at `back_rows` [R] (`backs`, `back_index`). `block` (chunk size) and
        `class_min` (the edges a (source, destination) pair needs to be a class): tests set them; by
        default `kernels.viterbi.layout` picks them for the grammar and vocabulary."""
        # imported here: importing canvasq.kernels fixes whether its kernels are interpreted (tests/kernels)
        from canvasq.kernels.viterbi import CLASS_MIN, TILE, csr, layout, viterbi

        R, C, V = len(rows), logits.shape[1], logits.shape[2]
        key = (block, V, class_min)
        if key not in self._csr:
            args = (self.src, self.tok, self.dst, self.free, self.g.Q, V)
            if block is None:
                self._csr[key] = layout(*args, class_min=class_min or CLASS_MIN)
            else:
                self._csr[key] = csr(*args, block, class_min or CLASS_MIN)
        if lse is None:
            step = max(1, GAIN_ELEMENTS // max(1, R * V))
            reads = [logits[rows, i0 : i0 + step].float() for i0 in range(0, C, step)]
            lse = torch.cat([torch.logsumexp(x, dim=-1) for x in reads], dim=1)
        start = states if isinstance(states, torch.Tensor) else to_device(states, self.device)
        toks, ends = viterbi(
            logits.contiguous(), rows, lse, back, start, self._csr[key], self.g.Q, tile or TILE, back_rows
        )
        return toks, ends

    def best_placed(
        self, start: torch.Tensor, logits: torch.Tensor, rows: torch.Tensor, back_rows: torch.Tensor, lse
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`best` on CUDA for rows whose start states and backward sets' places (`back_index`) are
        already [R] int32 device columns and whose canvases were checked completable when they began:
        the Viterbi's one launch and nothing else."""
        C = logits.shape[1]
        return self._best_kernel(start, logits, rows, self.backs(C), lse=lse, back_rows=back_rows)

    def _gains(
        self,
        logits: torch.Tensor,
        rows: torch.Tensor,
        back: torch.Tensor,
        i0: int,
        i1: int,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """[R, i1 - i0, E]: each edge's log-prob at positions i0..i1-1 (0 on the padding after the
        document, -inf where taking it leaves the document unfinishable)."""
        at = logits[rows, i0:i1].to(dtype)  # [R, c, V]
        gain = at.index_select(2, self.tok) - torch.logsumexp(at, dim=-1, keepdim=True)
        gain.masked_fill_(self.free, 0.0)
        return gain.masked_fill_(~back[:, i0 + 1 : i1 + 1][:, :, self.dst], float("-inf"))


@lru_cache(maxsize=256)
def _back_host(g: Grammar, C: int, budget: int) -> list[np.ndarray]:
    return g._backward(C, budget)


@lru_cache(maxsize=256)
def _back(dg: DeviceGrammar, C: int, budget: int) -> torch.Tensor:
    return torch.as_tensor(np.stack(_back_host(dg.g, C, budget)), device=dg.device)


@lru_cache(maxsize=64)
def device_grammar(grammar: Grammar, device: torch.device) -> DeviceGrammar:
    """One `DeviceGrammar` per grammar and device in a process."""
    return DeviceGrammar(grammar, device)
