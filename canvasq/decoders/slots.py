"""The slots of one decode stream: which request holds which arena slot, admission (a request that
cannot be decoded is answered at once, alone) and delivery (a finished row handed back and its slot
freed, emptied where graphed forwards may pad onto it). The rows handed back at one point of the
loop (an admission, the end of a step) are followed by one `flush`: a caller that stores rows writes
them together, before the next forward."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from canvasq.decoders.state import Seq, error_result, request_error
from canvasq.decoders.types import CANCELLED, DecodeRequest, DecodeResult

if TYPE_CHECKING:
    from canvasq.decoders.base import StepDecoder


class SlotPool:
    """The slots of one stream: which request holds which arena slot, admission and delivery."""

    def __init__(self, dec: StepDecoder, slots: int, seed: int, capacity: int, on_result, flush=None):
        self.dec, self.seed, self.capacity, self.on_result = dec, seed, capacity, on_result
        self.flush: Callable[[], None] = flush or (lambda: None)
        self.free = list(range(slots - 1, -1, -1))
        self.live: list[Seq] = []
        self.seen: list[Seq] = []  # every admitted request, for inspection (tests, schedules)
        self.keys: dict[int, object] = {}
        self.next_row = 0

    def admit(self, new: Sequence[tuple[object, DecodeRequest]]) -> list[Seq]:
        """Fed requests take free slots; one that cannot be decoded is answered at once, alone."""
        dec, fresh, answered = self.dec, [], False
        for key, req in new:
            err = request_error(dec.bundle, req)
            if err is None and dec.need(req) > self.capacity:
                err = f"needs {dec.need(req)} cache entries per slot; this stream holds {self.capacity}"
            if err:
                self.on_result(key, error_result(req, err, dec.name))
                answered = True
                continue
            s = Seq(
                row=self.next_row,
                req=req,
                slot=self.free.pop(),
                gen=dec.generator(self.seed, req.custom_id),
                n_canvases=-(-req.max_tokens // dec.C),
            )
            self.next_row += 1
            self.keys[s.row] = key
            dec.log.open(s.row)
            assert dec.arena is not None  # admitted: it fits the stream's capacity, so there is one
            dec.arena.reset(s.slot)
            fresh.append(s)
        self.live += fresh
        self.seen += fresh
        if answered:
            self.flush()
        return fresh

    def cancel(self) -> None:
        """`should_stop` said stop: the rows in flight end as cancelled and are handed over."""
        for s in self.live:
            if not s.done:
                s.error, s.finish_reason, s.done = CANCELLED, CANCELLED, True
        self.deliver_done()

    def deliver_done(self) -> None:
        """Hand every finished row to `on_result` and free its slot."""
        dec, delivered = self.dec, False
        for s in self.live:
            if not s.done:
                continue
            self.on_result(self.keys.pop(s.row), dec._result(s))
            delivered = True
            dec.log.close(s.row)
            if dec.graphs is not None:  # a free slot may pad graphed forwards: keep it empty
                assert dec.arena is not None  # rows were admitted
                dec.arena.reset(s.slot)
            self.free.append(s.slot)
        self.live = [s for s in self.live if not s.done]
        if delivered:
            self.flush()


def drain(
    dec: StepDecoder, reqs: Sequence[DecodeRequest], slots: int, seed: int = 0, occupancy: list | None = None
) -> list[DecodeResult]:
    """Every request of `reqs` through one `dec.stream` of `slots` slots (continuous batching, refilled
    as rows finish, as the worker decodes); their results in request order. `occupancy` as `stream`'s."""
    todo = list(enumerate(reqs))
    got: dict[int, DecodeResult] = {}

    def feed(n: int) -> list[tuple[int, DecodeRequest]]:
        taken, todo[:] = todo[:n], todo[n:]
        return taken

    dec.stream(
        feed, got.__setitem__, slots=slots, seed=seed, capacity=dec.capacity_for(reqs), occupancy=occupancy
    )
    return [got[i] for i in range(len(reqs))]
