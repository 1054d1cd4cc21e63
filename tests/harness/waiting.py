"""Deadline-bounded polling. A deadline is a safety net against a hung scenario, never a speed
assertion: scenarios assert outcomes (rows, statuses), not how long they took."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


class WaitTimeout(AssertionError):
    pass


def wait_for(
    cond: Callable[[], Any],
    what: str,
    deadline_s: float,
    every_s: float = 0.25,
    diagnose: Callable[[], str] | None = None,
    fail_if: Callable[[], str | None] | None = None,
) -> Any:
    """Poll `cond` until it returns a truthy value (returned). `fail_if` returning a message aborts
    early (e.g. a worker that should be alive exited); `diagnose` adds context to the failure."""
    end = time.monotonic() + deadline_s
    while True:
        try:
            value = cond()
        except Exception as exc:  # noqa: BLE001 - a service mid-restart: keep polling
            value, last_exc = None, exc
        else:
            last_exc = None
        if value:
            return value
        if fail_if is not None:
            msg = fail_if()
            if msg:
                raise WaitTimeout(f"while waiting for {what}: {msg}" + _extra(diagnose))
        if time.monotonic() >= end:
            tail = f" (last error: {last_exc!r})" if last_exc else ""
            raise WaitTimeout(f"gave up waiting for {what} after {deadline_s:.0f}s{tail}" + _extra(diagnose))
        time.sleep(every_s)


def _extra(diagnose: Callable[[], str] | None) -> str:
    if diagnose is None:
        return ""
    try:
        return "\n" + diagnose()
    except Exception as exc:  # noqa: BLE001 # pragma: no cover - diagnostics must never hide the real failure
        return f"\n(diagnostics failed: {exc!r})"
