"""`canvasq run`'s owner check (cli.embedded.owner_alive) on real processes of this host: a run is
still being generated only while its owner's pid runs canvasq."""

from __future__ import annotations

import socket
import subprocess
import sys
from datetime import timedelta
from types import SimpleNamespace

from canvasq.cli.embedded import owner_alive
from canvasq.core.settings import Settings
from canvasq.core.tables import utcnow


def _owner(pid: int, host: str | None = None, age_s: float = 0.0):
    return SimpleNamespace(
        pid=pid, host=host or socket.gethostname(), heartbeat_at=utcnow() - timedelta(seconds=age_s)
    )


def _sleeper(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", *args])


def test_a_live_canvasq_process_owns_its_run_and_others_do_not():
    settings = Settings()
    ours, other = _sleeper("canvasq", "run", "x.jsonl"), _sleeper("something-else")
    try:
        assert owner_alive(_owner(ours.pid), settings)
        assert not owner_alive(_owner(other.pid), settings)  # a reused pid running something else
    finally:
        for p in (ours, other):
            p.kill()
            p.wait()
    assert not owner_alive(_owner(ours.pid), settings)  # reaped: gone


def test_a_zombie_owner_is_not_alive():
    settings = Settings()
    ours = _sleeper("canvasq")
    ours.kill()
    import time

    time.sleep(0.3)  # killed, not yet reaped: a zombie
    try:
        assert not owner_alive(_owner(ours.pid), settings)
    finally:
        ours.wait()


def test_another_host_counts_by_heartbeat_and_none_is_no_owner():
    settings = Settings()
    assert owner_alive(_owner(1, host="elsewhere", age_s=1), settings)
    assert not owner_alive(_owner(1, host="elsewhere", age_s=10 * settings.heartbeat_s + 60), settings)
    assert not owner_alive(None, settings)
