"""Row statuses: the values of the status columns of runs, requests and chunks (`core.tables`).
No SQLAlchemy here, so the CLI's option choices come from it without loading the tables."""

from __future__ import annotations

from enum import StrEnum


# Status columns hold these values. Members are named as their values: a StrEnum compares equal to
# the string and every driver binds it as that string.
class RunStatus(StrEnum):
    queued = "queued"
    running = "running"
    completed = "completed"
    cancelling = "cancelling"
    cancelled = "cancelled"
    expired = "expired"
    interrupted = "interrupted"  # embedded only; not active (reconcile and finalize leave it alone)


class RequestStatus(StrEnum):
    queued = "queued"
    done = "done"
    errored = "errored"
    expired = "expired"
    cancelled = "cancelled"


class ChunkStatus(StrEnum):
    queued = "queued"
    running = "running"
    done = "done"
    failed = "failed"


RUN_ACTIVE = (RunStatus.queued, RunStatus.running, RunStatus.cancelling)
REQUEST_TERMINAL = (RequestStatus.done, RequestStatus.errored, RequestStatus.expired, RequestStatus.cancelled)
REQUEST_STATUSES = (RequestStatus.queued, *REQUEST_TERMINAL)
