"""A request's state inside a decode loop and the small rules around it: the canvases in flight
(`Canvas`), the row (`Seq`: slot, generator, tokens out, traces' stats), why a request cannot be
decoded (`request_error`), where an answer ends (`first_stop`), and its own generator (`row_generator`)."""

from __future__ import annotations

import zlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from canvasq.decoders.types import DecodeRequest, DecodeResult, FinishReason


def request_error(bundle, req: DecodeRequest) -> str | None:
    """Why a request cannot be decoded at all (checked before it joins a batch), or None."""
    if not req.prompt_ids:
        return "empty prompt"
    if req.max_tokens <= 0:
        return f"max_tokens must be positive, got {req.max_tokens}"
    from canvasq.decoders.types import token_budget_error  # the validator's rule too (core.schemas)

    limit = getattr(bundle.config.get_text_config(), "max_position_embeddings", None)
    return token_budget_error(len(req.prompt_ids), req.max_tokens, bundle.canvas_length, limit)


def error_result(
    req: DecodeRequest, error: str, decoder: str, finish_reason: str = FinishReason.error
) -> DecodeResult:
    """A request that produced nothing: refused, failed or cancelled before it finished."""
    return DecodeResult(
        custom_id=req.custom_id,
        token_ids=[],
        text="",
        finish_reason=finish_reason,
        prompt_tokens=len(req.prompt_ids),
        forwards=0,
        error=error,
        decoder=decoder,
    )


class Cancelled(Exception):
    """Raised by `poll` between forwards once `should_stop()` turns true; the decoder turns it into
    CANCELLED rows."""


def poll(should_stop) -> None:
    if should_stop is not None and should_stop():
        raise Cancelled()


def first_stop(tokens: list[int], stop_ids: frozenset[int]) -> int | None:
    """Index of the first token that ends the answer, or None.

    EOS ends it; so does PAD: the sampler writes pad only after EOS, so a committed pad means an EOS
    was lost to parallel decoding ("high house") and everything after it is padding. Counting those
    pads as generated tokens would inflate tok/s."""
    for i, t in enumerate(tokens):
        if t in stop_ids:
            return i
    return None


def row_generator(seed: int, custom_id: str) -> torch.Generator:
    """A request's own RNG: its draws do not depend on which other rows share the batch."""
    g = torch.Generator()
    g.manual_seed((int(seed) * 1_000_003 + zlib.crc32(custom_id.encode())) % (2**63))
    return g


@dataclass
class Canvas:
    """One canvas in flight. Tensors are [C] on the model's device."""

    index: int  # 0-based canvas number within the answer
    start: int  # absolute position of its first row
    tokens: torch.Tensor  # long: current input ids (the final id at committed positions)
    committed: torch.Tensor  # bool
    state: str  # "full" | "semi" | "draft"
    pending: torch.Tensor | None = None  # bool, funnel: committed, rides once more, then promoted
    age: int = 0  # decoder forwards this canvas has ridden (pipe, funnel; official: `SlotState.left`)
    streak: int = 0  # consecutive committing steps with ≤ jacobi_max_commits commits
    # self-conditioning for its next forward, in the decoder's own form: official keeps the window's
    # input (None | [C, V] | ([C, k], [C, k]), views of its slot's); pipe keeps (that input, [C] bool
    # rows that have it)
    sc: Any = None
    prev_eos: torch.Tensor | None = None  # bool: argmax was EOS on the previous step (EOS streak)
    # a revising front (pipe / funnel `front="revise"`): its steps as the front, the share of its
    # positions that cleared τ_conf on the last one, and which ones (decoders/front.py)
    front_steps: int = 0
    settled: float = 0.0
    sure: torch.Tensor | None = None
    history: torch.Tensor | None = None  # `front="native"`: the stopping rule's last S argmax [1, S, C]

    @property
    def length(self) -> int:
        return int(self.tokens.numel())

    @property
    def decoded(self) -> float:
        """Decode fraction: share of positions committed."""
        return float(self.committed.float().mean())

    @property
    def end(self) -> int:
        return self.start + self.length

    def livelocked(self, n_new: int, window: int, max_commits: int) -> bool:
        """Jacobi livelock: the `window`-th consecutive step with at most `max_commits` commits (the
        streak then starts over). Drafts never count."""
        if self.state == "draft":
            return False
        self.streak = self.streak + 1 if n_new <= max_commits else 0
        if self.streak < window:
            return False
        self.streak = 0
        return True


@dataclass
class Seq:
    """One request in flight."""

    row: int  # index in the batch
    req: DecodeRequest
    slot: int
    gen: torch.Generator
    n_canvases: int  # canvases needed to cover max_tokens
    spawned: int = 0
    canvases: list[Canvas] = field(default_factory=list)
    retired: list[Canvas] = field(default_factory=list)  # kept for inspection (tests, schedules)
    out: list[int] = field(default_factory=list)  # tokens of retired canvases
    done: bool = False
    finish_reason: str = FinishReason.length
    error: str | None = None
    stats: Counter = field(default_factory=Counter)
    steps: int = 0  # decoder steps this request has been live for (liveness budget)

    @property
    def prompt_len(self) -> int:
        return len(self.req.prompt_ids)
