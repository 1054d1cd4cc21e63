"""`--decoder auto`: pick a decoder and its knobs from the request's task (Part 3's serving split).

- math-like (routine maths, max-speed easy regimes) → funnel: τ_conf 0.7, self-conditioning on,
  arena promotion, k = 2 canvases;
- code (hard code) → D2F pipe: τ_conf 0.85, EOS priority τ_eos 0.5, draft spawn.

A routing table from settings (`CANVASQ_ROUTING`, task → decoder name) replaces the decoder for the
tasks it lists; per-request overrides are applied on top by `run_batch`. Unknown or missing tasks
take the pipe at its defaults (τ_conf 0.9): the conservative arm.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MATH_TASKS = frozenset({"math", "arith", "gsm8k", "maths", "arithmetic"})
CODE_TASKS = frozenset({"code", "humaneval", "mbpp", "python"})


@dataclass(frozen=True)
class Route:
    decoder: str
    overrides: dict = field(default_factory=dict)


MATH_ROUTE = Route(
    "funnel", {"tau_conf": 0.7, "self_conditioning": True, "promote": "arena", "max_canvases": 2}
)
CODE_ROUTE = Route("pipe", {"tau_conf": 0.85, "tau_eos": 0.5, "draft_spawn": True})
DEFAULT_ROUTE = Route("pipe", {})


def task_kind(task: str | None) -> str | None:
    t = (task or "").strip().lower()
    if t in MATH_TASKS:
        return "math"
    if t in CODE_TASKS:
        return "code"
    return None


def route(task: str | None, table: dict[str, str] | None = None) -> Route:
    """The decoder and config overrides for one request's task."""
    kind = task_kind(task)
    built_in = {"math": MATH_ROUTE, "code": CODE_ROUTE}.get(kind, DEFAULT_ROUTE)
    if table:
        for key in (task, kind):
            if key and key in table:
                name = table[key]
                if name == "auto":
                    break
                # keep the built-in knobs only when the table names the same decoder
                return built_in if name == built_in.decoder else Route(name, {})
    return built_in
