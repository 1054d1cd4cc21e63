"""`--decoder auto`: which decoder (and knobs) serves a request.

Auto never trades accuracy silently. In order:

1. the settings table `CANVASQ_ROUTING` (task or kind → decoder): an explicit choice, taken as is;
2. the model's calibration (`canvasq calibrate`, stored per model identity, `calibration.Calibration`):
   per task family, the fastest measured setting (decoder + knobs) whose dev-set accuracy is within
   `budget` points (`CANVASQ_ROUTING_BUDGET`, default 2) of `official` at the checkpoint's settings;
3. otherwise `official` (the native sampler, the accurate arm), said once in the log.

The step decoders (pipe, funnel) lose 17-28 points on the testbed at their defaults (BENCHMARKS.md),
so without a calibration that measured them on the loaded model they never serve.
Per-request overrides are applied on top by `run_batch`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from canvasq.decoders.calibration import Calibration

log = logging.getLogger(__name__)

MATH_TASKS = frozenset({"math", "arith", "gsm8k", "maths", "arithmetic"})
CODE_TASKS = frozenset({"code", "humaneval", "mbpp", "python"})
DEFAULT_BUDGET = 2.0  # accuracy points below the official algorithm auto may give up (a setting)


@dataclass(frozen=True)
class Route:
    decoder: str
    overrides: dict = field(default_factory=dict)
    source: str = "default"  # where the entry came from: "default" | "settings" | "calibration"


DEFAULT_ROUTE = Route("official", {}, "default")
_SAID: dict[str, bool] = {}


def task_kind(task: str | None) -> str | None:
    t = (task or "").strip().lower()
    if t in MATH_TASKS:
        return "math"
    if t in CODE_TASKS:
        return "code"
    return None


def _once(key: str, msg: str, *args) -> None:
    if not _SAID.get(key):
        _SAID[key] = True
        log.info(msg, *args)


def route(
    task: str | None,
    table: dict[str, str] | None = None,
    calibration: Calibration | None = None,
    budget: float | None = None,
) -> Route:
    """The decoder and config overrides for one request's task: the table's entry for the task (or
    its kind: math / code), else the calibration's pick for its family, else `official`."""
    keys = [k for k in (task, task_kind(task)) if k]
    if table:
        for key in keys:
            if key in table and table[key] != "auto":
                return Route(table[key], {}, "settings")
    if calibration is not None:
        for key in reversed(keys):  # calibrations are keyed by family (math / code) first
            pick = calibration.choose(key, DEFAULT_BUDGET if budget is None else budget)
            if pick is not None:
                return Route(pick.decoder, dict(pick.knobs), "calibration")
        _once(
            f"uncal:{task}",
            "--decoder auto: the calibration has no family for task %r; using 'official'",
            task,
        )
        return DEFAULT_ROUTE
    _once(
        "nocal",
        "--decoder auto: no calibration for the loaded model (canvasq calibrate); "
        "task %r and every other uncalibrated task go to 'official' (the accurate sampler)",
        task,
    )
    return DEFAULT_ROUTE


def group_by_route(
    tasks: list[str | None],
    table: dict[str, str] | None = None,
    calibration: Calibration | None = None,
    budget: float | None = None,
    overrides: dict | None = None,
) -> list[tuple[str, dict, list[int]]]:
    """(decoder, knobs, indices into `tasks`) per distinct route, in first-seen order; `overrides`
    apply on top of each route's knobs. `run_batch` and the worker split an `auto` batch with it."""
    groups: dict[tuple, tuple[str, dict, list[int]]] = {}
    for i, task in enumerate(tasks):
        r = route(task, table, calibration, budget)
        knobs = {**r.overrides, **(overrides or {})}
        key = (r.decoder, tuple(sorted(knobs.items())))
        groups.setdefault(key, (r.decoder, knobs, []))[2].append(i)
    return list(groups.values())


def routing_table(
    table: dict[str, str] | None = None,
    calibration: Calibration | None = None,
    budget: float | None = None,
) -> list[tuple[str, str, str]]:
    """(task, decoder, source) rows for `canvasq config`: the settings entries, the calibration's
    picks per family, then the default."""
    from canvasq.decoders.configs import knobs_label

    budget = DEFAULT_BUDGET if budget is None else budget
    rows = [(task, dec, "CANVASQ_ROUTING") for task, dec in sorted((table or {}).items())]
    if calibration is not None:
        for fam in calibration.families():
            pick, ref = calibration.choose(fam, budget), calibration.reference(fam)
            if pick is None or ref is None:
                continue
            if (table or {}).get(fam):
                continue  # the settings entry above wins
            rows.append(
                (
                    fam,
                    knobs_label(pick.decoder, pick.knobs),
                    (
                        f"{calibration.describe()}: {pick.accuracy * 100:.1f} % vs official "
                        f"{ref.accuracy * 100:.1f} % (budget {budget:g}), {pick.tok_s:.0f} vs "
                        f"{ref.tok_s:.0f} tok/s"
                    ),
                )
            )
        rows.append(("(any other)", DEFAULT_ROUTE.decoder, "default: not in the calibration"))
    else:
        rows.append(("(any other)", DEFAULT_ROUTE.decoder, "default: no calibration, the accurate sampler"))
    return rows
