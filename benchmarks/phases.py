"""Host seconds of a decode by phase, each second counted once: the innermost phase running gets it.

A testbed step on a GPU is bound by its host work (a torch.profiler trace on an H100: the device busy
17-18 % of the wall), so a constrained arm's slower steps have to be found on the host's clock:
`PhaseClock` wraps the decoder's methods for the time of a `with` block and adds up, per phase, the
wall each spent outside the phases it called. What no phase covers (the stream's own loop, the
drain's callbacks) is the wall less their sum. The step's host sync is inside `step`'s own time, so
on a GPU `step` also holds the wait for the device's queued work. Python's cyclic garbage collections
are a phase of their own (`gc`, taken out of the phase they interrupted), with their count by
generation (`gc_runs`).

    with PhaseClock() as clock:
        drain(dec, reqs, 64)
    clock.seconds  # {"forward": ..., "mask": ..., ...}

Each wrapped call costs about a microsecond: a step makes a few dozen.
"""

from __future__ import annotations

import functools
import gc
import time
from collections import Counter
from typing import Self

from canvasq.decoders import base, constrained, constraint_rules, official

# (class or module, function, phase): a function's own time goes to its phase. The constraint's hooks
# are split into their parts (`mask_*`, `final_read`), so `mask` keeps only what none of them covers:
# on a GPU the parts' launches and the Python around them are told apart
PHASES = (
    (official.OfficialDecoder, "step", "step"),
    (base.StepDecoder, "forward", "forward"),
    (official.OfficialDecoder, "_sample", "sample"),
    (constrained.CanvasConstraints, "mask", "mask"),
    (constrained.PlanTable, "ids", "mask_plans"),
    (constrained.CanvasConstraints, "_step_rows", "mask_rows"),
    (constrained.CanvasConstraints, "_constrain", "mask_constrain"),  # the kernel path (CUDA)
    (constrained.CanvasConstraints, "_ban_and_open", "mask_constrain"),  # the torch path
    (constrained.CanvasConstraints, "_best", "mask_best"),
    (constrained, "step_rules", "mask_rules"),  # module functions: patched where mask calls them
    (constrained, "pin", "mask_pin"),
    (constraint_rules.SlotRules, "read_with", "final_read"),
    (constrained.CanvasConstraints, "final", "final"),
    (constrained.CanvasConstraints, "begin", "begin"),
    (constrained.CanvasConstraints, "checked", "checked"),
    (base.StepDecoder, "retire_canvases", "retire"),
    (base.StepDecoder, "encode", "encode"),
    (base.StepDecoder, "prefill", "prefill"),
    (base.StepDecoder, "spawn", "spawn"),
)


class PhaseClock:
    """Per-phase host seconds (exclusive of nested phases) of what runs inside the `with` block."""

    def __init__(self) -> None:
        self.seconds: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()
        self._stack: list[list] = []  # [phase, start, seconds of nested phases]
        self._saved: list[tuple[type, str, object]] = []
        self._gc_start = 0.0

    def _gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
            return
        spent = time.perf_counter() - self._gc_start
        self.seconds["gc"] += spent
        self.calls[f"gc{info['generation']}"] += 1
        if self._stack:
            self._stack[-1][2] += spent

    def __enter__(self) -> Self:
        for cls, name, phase in PHASES:
            inner = vars(cls)[name]
            self._saved.append((cls, name, inner))
            setattr(cls, name, self._timed(inner, phase))
        gc.callbacks.append(self._gc)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._gc)
        for cls, name, inner in reversed(self._saved):
            setattr(cls, name, inner)
        self._saved = []

    def _timed(self, fn, phase: str):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            frame = [phase, time.perf_counter(), 0.0]
            self._stack.append(frame)
            try:
                return fn(*args, **kwargs)
            finally:
                self._stack.pop()
                spent = time.perf_counter() - frame[1]
                self.seconds[phase] += spent - frame[2]
                self.calls[phase] += 1
                if self._stack:
                    self._stack[-1][2] += spent

        return run

    def report(self, wall: float, steps: int) -> dict:
        """Per phase, host ms a decoder step; `rest`: the wall no phase covers."""
        per = {k: 1e3 * v / max(1, steps) for k, v in sorted(self.seconds.items())}
        per["rest"] = 1e3 * (wall - sum(self.seconds.values())) / max(1, steps)
        runs = {k: v for k, v in sorted(self.calls.items()) if k.startswith("gc")}
        return {"phase_ms_step": {k: round(v, 3) for k, v in per.items()}, "gc_runs": runs}
