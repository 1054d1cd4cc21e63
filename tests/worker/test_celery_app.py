"""Celery settings per RELIABILITY.md, the import boundaries, and the worker refusing to start with
out-of-order time limits (a real `canvasq worker` process)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from canvasq.core.settings import Settings
from canvasq.worker.celery_app import celery_config, make_app
from tests.harness.backends import REDIS_URL, unique_queue


def test_reliability_settings():
    s = Settings(soft_time_limit=100, hard_time_limit=200, visibility_timeout=300, model="/m/testbed")
    conf = make_app(s).conf
    assert conf.task_acks_late is True and conf.task_reject_on_worker_lost is True
    assert conf.worker_prefetch_multiplier == 1 and conf.task_ignore_result is True
    assert (conf.task_soft_time_limit, conf.task_time_limit) == (100, 200)
    assert conf.broker_transport_options["visibility_timeout"] == 300
    assert conf.task_default_queue == "canvasq.testbed"
    assert conf.worker_send_task_events is True
    assert (
        celery_config(s)["broker_transport_options"]["visibility_timeout"]
        > celery_config(s)["task_time_limit"]
    )


def _imports(module: str) -> list[str]:
    code = (
        f"import sys, {module}\n"
        "print(','.join(m for m in ('torch', 'transformers', 'celery') if m in sys.modules))"
    )
    return (
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        .stdout.strip()
        .split(",")
    )


def test_celery_app_does_not_import_torch():
    assert "torch" not in _imports("canvasq.worker.celery_app")
    assert "torch" not in _imports("canvasq.worker.tasks")


def test_runtime_does_not_import_celery_or_torch():
    heavy = _imports("canvasq.worker.engine")
    assert "celery" not in heavy and "torch" not in heavy


@pytest.mark.parametrize("entry", ["canvasq", "celery"])
def test_worker_refuses_visibility_timeout_below_hard_limit(tmp_path, entry):
    """T6: visibility_timeout ≤ hard limit → the worker exits non-zero before consuming anything."""
    env = {
        **os.environ,
        "CANVASQ_DATABASE_URL": f"sqlite:///{tmp_path / 'x.sqlite'}",
        "CANVASQ_BROKER_URL": REDIS_URL,
        "CANVASQ_VISIBILITY_TIMEOUT": "60",
        "CANVASQ_HARD_TIME_LIMIT": "120",
        "CANVASQ_SOFT_TIME_LIMIT": "100",
    }
    subprocess.run(
        [sys.executable, "-m", "canvasq.cli", "db", "upgrade"], env=env, check=True, capture_output=True
    )
    queue = unique_queue()
    if entry == "canvasq":
        cmd = [sys.executable, "-m", "canvasq.cli", "worker", "--queue", queue]
    else:
        cmd = [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "canvasq.worker.celery_app:app",
            "worker",
            "-Q",
            queue,
            "-c",
            "1",
            "--without-gossip",
            "--without-mingle",
        ]
    proc = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "visibility_timeout > hard_time_limit > soft_time_limit" in proc.stderr + proc.stdout
