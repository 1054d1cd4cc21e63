"""The store the CLI and the Batch API open: the queue protocol and the reports over one engine.

The worker needs only `core.queue.QueueStore`; anything that reports opens `Store`. Modules:
db (engine, migrations, shared helpers), queue (the protocol: submission, claims, results),
reports (read-only queries), tables (SQL tables, status enums), calibrations (stored calibrations);
the queue protocol's faces: records (what crosses rooms), runs (whole-run control), workers (liveness).
"""

from __future__ import annotations

from canvasq.core.queue import QueueStore
from canvasq.core.reports import Reports


class Store(QueueStore, Reports):
    """Both faces of the store over one engine."""
