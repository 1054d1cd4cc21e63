"""`--decoder auto`: which decoder (and knobs) serves a request.

Auto never trades accuracy silently: with no routing entry for a request's task, it goes to
`official` (the native sampler on canvasq's runtime, the accurate arm). The step decoders (pipe,
funnel) are faster per token but lose 20-50 points on the testbed at their seed settings
(BENCHMARKS.md), so they serve a task only when a routing table names them for it: the settings
table `CANVASQ_ROUTING` (task → decoder) today, a per-model calibration (`canvasq calibrate`) once one
exists. Per-request overrides are applied on top by `run_batch`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

MATH_TASKS = frozenset({"math", "arith", "gsm8k", "maths", "arithmetic"})
CODE_TASKS = frozenset({"code", "humaneval", "mbpp", "python"})


@dataclass(frozen=True)
class Route:
    decoder: str
    overrides: dict = field(default_factory=dict)
    source: str = "default"  # where the entry came from: "default" | "settings"


DEFAULT_ROUTE = Route("official", {}, "default")
_SAID = {"default": False}


def task_kind(task: str | None) -> str | None:
    t = (task or "").strip().lower()
    if t in MATH_TASKS:
        return "math"
    if t in CODE_TASKS:
        return "code"
    return None


def route(task: str | None, table: dict[str, str] | None = None) -> Route:
    """The decoder and config overrides for one request's task: the table's entry for the task (or
    its kind: math / code), else `official`."""
    if table:
        for key in (task, task_kind(task)):
            if key and key in table and table[key] != "auto":
                return Route(table[key], {}, "settings")
    if not _SAID["default"]:
        _SAID["default"] = True
        log.info("--decoder auto: no routing entry for task %r; using 'official' (the accurate sampler)", task)
    return DEFAULT_ROUTE


def routing_table(table: dict[str, str] | None = None) -> list[tuple[str, str, str]]:
    """(task, decoder, source) rows for `canvasq config`: the settings entries, then the default."""
    rows = [(task, dec, "CANVASQ_ROUTING") for task, dec in sorted((table or {}).items())]
    rows.append(("(any other)", DEFAULT_ROUTE.decoder, "default: no calibration, the accurate sampler"))
    return rows
