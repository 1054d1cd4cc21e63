"""A schema's automaton on the decoder's device: the canvas masks (`Grammar.plan`) and the best
completable path (`Grammar.best`) for many rows at once, in torch, so a constrained canvas's logits
never leave the device.

At the testbed's vocabulary (748) the host versions cost ~11 % of a request's wall; at the real one
(262,144) they would copy [rows, C, V] fp32 log-probs to the host every step (64 rows × 256 × 262,144
× 4 bytes = 17 GB) and build each canvas's [C, V] mask there. Here the log-probs are read only at the
automaton's edges ([rows, E]), the Viterbi runs C steps of batched scatter-max over the edges, and
only the chosen tokens ([rows, C]) and end states come back.

Same answers as `structured.Grammar`: the same masks, and the same path (ties to the highest edge
index, as `Grammar.best` breaks them); tests compare the two on random log-probs.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch

from canvasq.decoders.structured import Grammar, Unfinishable


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

    def back(self, C: int, budget: int) -> torch.Tensor:
        """[C + 1, Q] bool: `Grammar._backward` on the device (cached per C and budget)."""
        return _back(self, C, budget)

    def plan(self, state: int, C: int, budget: int, V: int) -> torch.Tensor:
        """[C, V] bool: `Grammar.plan`'s masks, built on the device (tokens past the tokenizer's
        vocabulary stay False)."""
        back = self.back(C, budget)
        if not bool(back[0, state]):
            raise Unfinishable(f"the document cannot be finished within {budget} tokens")
        masks = torch.zeros(C, V, dtype=torch.bool, device=self.device)
        here = torch.zeros(self.g.Q, dtype=torch.bool, device=self.device)
        here[state] = True
        for i in range(C):
            take = here[self.src] & back[i + 1][self.dst]
            masks[i, self.tok[take]] = True
            here = torch.zeros_like(here)
            here[self.dst[take]] = True
        return masks

    def best(
        self, states: list[int], logits: torch.Tensor, budgets: list[int], rows: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, list[int]]:
        """Each row's best completable path from its state under its log-softmax of `logits` [B, C, V]
        (on the device; `rows`: the R rows of B to read, all by default) within its budget: ([R, C]
        tokens on the device, [R] end states). One position at a time: no [R, C, V] copy is made."""
        rows = torch.arange(logits.shape[0], device=logits.device) if rows is None else rows
        R, C = len(rows), logits.shape[1]
        Q, E = self.g.Q, len(self.g.src)
        back = torch.stack([self.back(C, b) for b in budgets])  # [R, C + 1, Q]
        start = torch.as_tensor(states, device=self.device)
        if not bool(back[torch.arange(R, device=self.device), 0, start].all()):
            raise Unfinishable("a canvas's document cannot be finished within its budget")
        dtype = torch.promote_types(logits.dtype, torch.float32)
        score = torch.full((R, Q), float("-inf"), dtype=dtype, device=self.device)
        score[torch.arange(R, device=self.device), start] = 0.0
        dst = self.dst.expand(R, E)
        via = torch.empty(R, C, Q, dtype=torch.long, device=self.device)
        for i in range(C):
            at = logits[rows, i].to(dtype)  # [R, V]
            gain = at[:, self.tok] - torch.logsumexp(at, dim=-1, keepdim=True)  # [R, E]: the edges' log-probs
            gain = gain.masked_fill(self.free, 0.0)
            cand = (score[:, self.src] + gain).masked_fill(~back[:, i + 1][:, self.dst], float("-inf"))
            score = torch.full_like(score, float("-inf")).scatter_reduce(1, dst, cand, "amax")
            won = (cand == score.gather(1, dst)) & torch.isfinite(cand)
            via[:, i] = torch.full_like(score, -1, dtype=torch.long).scatter_reduce(
                1, dst, torch.where(won, self.edge, -1), "amax"
            )
        q = score.argmax(1)
        ends = q.tolist()
        toks = torch.empty(R, C, dtype=torch.long, device=self.device)
        for i in range(C - 1, -1, -1):
            e = via[:, i].gather(1, q[:, None])[:, 0]
            toks[:, i] = self.tok[e]
            q = self.src[e]
        return toks, ends


@lru_cache(maxsize=256)
def _back(dg: DeviceGrammar, C: int, budget: int) -> torch.Tensor:
    return torch.as_tensor(np.stack(dg.g._backward(C, budget)), device=dg.device)


@lru_cache(maxsize=64)
def device_grammar(grammar: Grammar, device: torch.device) -> DeviceGrammar:
    """One `DeviceGrammar` per grammar and device in a process."""
    return DeviceGrammar(grammar, device)
