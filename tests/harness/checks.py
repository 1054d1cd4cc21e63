"""The exactly-once check every reliability scenario ends with, read straight from the store:

- every input custom_id has exactly one request row and exactly one output row, and nothing else
  is there (no unknown ids, no second row for an id);
- every request row is terminal (done / errored / expired / cancelled), its output agrees with it
  (done ⇔ no error code);
- the counts the service reports (`Store.counts`, a GROUP BY) sum to the total;
- optionally the run itself is terminal and the statuses are the ones the scenario expects.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from sqlalchemy import select

from canvasq.core.statuses import REQUEST_TERMINAL
from canvasq.core.store import Store
from canvasq.core.tables import Output, Request, Run
from tests.harness.probes import chunk_attempts

RUN_TERMINAL = ("completed", "cancelled", "expired")


@dataclass
class Report:
    run_id: str
    total: int
    lost: list[str] = field(default_factory=list)  # input ids without a terminal row + output
    duplicated: list[str] = field(default_factory=list)  # ids with more than one request/output row
    unknown: list[str] = field(default_factory=list)  # rows for ids that were not in the input
    not_terminal: list[str] = field(default_factory=list)
    inconsistent: list[str] = field(default_factory=list)  # status and output disagree
    statuses: dict[str, int] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    run_status: str | None = None
    error_codes: dict[str, int] = field(default_factory=dict)
    attempts: dict[str, int] = field(default_factory=dict)  # chunk id -> deliveries

    @property
    def ok(self) -> bool:
        return not (
            self.lost or self.duplicated or self.unknown or self.not_terminal or self.inconsistent
        ) and (
            self.counts.get("total") == self.total == sum(v for k, v in self.counts.items() if k != "total")
        )

    def describe(self) -> str:
        def few(xs):
            return f"{len(xs)} {xs[:8]}" if xs else "0"

        return (
            f"run {self.run_id} ({self.run_status}): total {self.total}, statuses {self.statuses}, "
            f"counts {self.counts}, error codes {self.error_codes}; lost {few(self.lost)}, duplicated "
            f"{few(self.duplicated)}, unknown {few(self.unknown)}, not terminal {few(self.not_terminal)}, "
            f"inconsistent {few(self.inconsistent)}; chunk attempts {self.attempts}"
        )


def collect(store: Store, run_id: str, input_ids: Iterable[str]) -> Report:
    ids = list(input_ids)
    rep = Report(run_id, len(ids))
    with store.Session() as s:
        req_rows = s.execute(select(Request.custom_id, Request.status).where(Request.run_id == run_id)).all()
        out_rows = s.execute(select(Output.custom_id, Output.error_code).where(Output.run_id == run_id)).all()
        rep.run_status = s.scalar(select(Run.status).where(Run.id == run_id))
    rep.attempts = chunk_attempts(store, run_id)
    req_n = Counter(c for c, _ in req_rows)
    out_n = Counter(c for c, _ in out_rows)
    status = {c: st for c, st in req_rows}
    err = {c: e for c, e in out_rows}
    wanted = set(ids)
    rep.duplicated = sorted(
        {c for c, n in (req_n + out_n).items() if req_n[c] > 1 or out_n[c] > 1}
        | {c for c, n in Counter(ids).items() if n > 1}
    )
    rep.unknown = sorted((set(req_n) | set(out_n)) - wanted)
    rep.lost = sorted(c for c in wanted if req_n[c] == 0 or out_n[c] == 0)
    rep.not_terminal = sorted(c for c in wanted if c in status and status[c] not in REQUEST_TERMINAL)
    rep.inconsistent = sorted(
        c for c in wanted if c in status and c in err and (status[c] == "done") != (err[c] is None)
    )
    rep.statuses = dict(Counter(status.values()))
    rep.error_codes = dict(Counter(e for e in err.values() if e))
    rep.counts = store.counts(run_id)
    return rep


def assert_exactly_once(
    store: Store,
    run_id: str,
    input_ids: Iterable[str],
    *,
    run_status: str | tuple | None = RUN_TERMINAL,
    statuses: dict[str, int] | None = None,
) -> Report:
    """Raise AssertionError with a full description unless the run is exactly-once and terminal."""
    rep = collect(store, run_id, input_ids)
    assert rep.ok, "exactly-once check failed: " + rep.describe()
    if run_status is not None:
        allowed = (run_status,) if isinstance(run_status, str) else tuple(run_status)
        assert rep.run_status in allowed, f"run status {rep.run_status!r} not in {allowed}: " + rep.describe()
    if statuses is not None:
        assert rep.statuses == statuses, f"statuses {rep.statuses} != expected {statuses}: " + rep.describe()
    return rep
