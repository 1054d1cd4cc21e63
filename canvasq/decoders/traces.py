"""A stream's record of model passes (`PassLog`) and the timer of one pass (`PassTimer`).

Every model pass (the prefill encode, each decoder forward, each encoder commit pass) is recorded per
request it carried: G (rows) and τ (commits) batch-wide and the request's own, as a `ForwardTrace`; a
row's `forwards` is the count of passes that carried it.

Timing: CUDA events on CUDA (no device synchronisation per pass), perf_counter on the CPU. Reading
`ms` waits for the pass's end event, which costs nothing after the step's host sync: the decoder passes
of official, pipe and phcd are recorded after theirs. An encoder pass recorded at once
(`StepDecoder.encode_commits` with no deferral, pipe's and phcd's commit passes) waits for its own end
event. `record` also takes the timer itself and fills the traces' `ms` when the log settles (after the
next step): the prefill's encoder pass is never waited for on its own.
"""

from __future__ import annotations

import time

import torch

from canvasq.decoders.types import ForwardTrace


class PassTimer:
    """One pass's time in ms. On CUDA two events on the device's current stream (what the GPU spent
    from the pass's first launch to its last; nothing is synchronised): `ms` waits for the end event
    the first time it is read (no wait after a host sync that follows the pass). On the CPU the
    wall time of the block (perf_counter)."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._ms = 0.0
        self._events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None

    def __enter__(self):
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(torch.cuda.current_stream(self.device))
            self._events = (start, end)
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self._events is not None:
            self._events[1].record(torch.cuda.current_stream(self.device))
        else:
            self._ms = (time.perf_counter() - self.t0) * 1e3
        return False

    @property
    def ms(self) -> float:
        if self._events is not None:
            start, end = self._events
            end.synchronize()
            self._ms, self._events = start.elapsed_time(end), None
        return self._ms


class PassLog:
    """The traces of one stream's live rows, by row, in pass order."""

    def __init__(self) -> None:
        self.by_row: dict[int, list[ForwardTrace]] = {}
        self.index = 0  # passes so far
        self._untimed: list[tuple[PassTimer, list[ForwardTrace]]] = []  # traces whose time is pending

    def open(self, row: int) -> None:
        self.by_row[row] = []

    def close(self, row: int) -> None:
        self.by_row.pop(row, None)

    def of(self, row: int) -> list[ForwardTrace]:
        return self.by_row.get(row, [])

    def record(self, kind, ms: float | PassTimer, rows, commits, states) -> None:
        """One model pass: a trace for each request it carried (G and τ batch-wide and its own). `ms`:
        the pass's time, or its timer, read when the log settles."""
        total_rows, total_commits = sum(rows.values()), sum(commits.values())
        canvases = sum(len(v.split(",")) for v in states.values())
        traces = [
            ForwardTrace(
                index=self.index,
                rows=total_rows,
                commits=total_commits,
                canvases=canvases,
                states=states.get(row, ""),
                ms=0.0 if isinstance(ms, PassTimer) else ms,
                kind=kind,
                own_rows=own,
                own_commits=commits.get(row, 0),
            )
            for row, own in rows.items()
        ]
        for row, trace in zip(rows, traces):
            self.by_row[row].append(trace)
        if isinstance(ms, PassTimer):
            self._untimed.append((ms, traces))
        self.index += 1

    def settle(self) -> None:
        """The pending passes' times into their traces (after a step's host sync: no wait)."""
        for timer, traces in self._untimed:
            for trace in traces:
                trace.ms = timer.ms
        self._untimed = []
