"""Expiry of files (issue 36): `output_expires_after` at batch creation and `expires_after` at upload,
through the stock `openai` client against a real `canvasq serve` on SQLite. The policy sets each file's
`expires_at`; a file past it is gone for every route at once, and the server's finalizer deletes its
row and bytes. Time is moved by ageing the row in SQL (the bounds are 1 h to 30 days)."""

from __future__ import annotations

import time
from datetime import timedelta

import openai
import pytest
from openai import OpenAI
from sqlalchemy import select, update

from canvasq.core.store import Store
from canvasq.core.tables import ApiFile, utcnow
from tests.harness.backends import REDIS_URL, drop_queue, unique_queue
from tests.harness.server import ENDPOINT, ServerProcess, batch_lines, cli, poll, upload
from tests.harness.workers import worker_env
from tests.serve.inprocess import finish_run


@pytest.fixture
def served(tmp_path):
    """A server on SQLite with no worker (runs are finished through the store): client, store, server,\n    files directory."""
    url, prefix = f"sqlite:///{tmp_path / 'canvasq.sqlite'}", unique_queue("cqexp")
    env = worker_env(  # chunks go to a Redis queue nobody consumes
        db_url=url,
        broker_url=REDIS_URL,
        extra={
            "CANVASQ_QUEUE_PREFIX": prefix,
            "CANVASQ_FILES_DIR": str(tmp_path / "files"),
            "CANVASQ_FINALIZE_EVERY_S": "0.2",
        },
    )
    key = cli(env, "keys", "create", "--project", "alpha").stdout.strip()
    with ServerProcess(env, tmp_path / "serve.log", with_worker=False) as srv:
        srv.wait_ready()
        store = Store(url)
        try:
            yield OpenAI(base_url=srv.base_url, api_key=key, max_retries=0), store, srv, tmp_path / "files"
        finally:
            store.dispose()
            drop_queue(f"{prefix}.testbed")


def _age(store, file_id: str) -> None:
    """Move the file's expiry into the past, as the clock would."""
    with store.Session.begin() as s:
        s.execute(
            update(ApiFile).where(ApiFile.id == file_id).values(expires_at=utcnow() - timedelta(seconds=1))
        )


def _path(store, files_dir, file_id: str):
    with store.Session() as s:
        return files_dir / s.scalar(select(ApiFile.path).where(ApiFile.id == file_id))


def test_output_expires_after_sets_and_deletes(served):
    client, store, srv, files_dir = served
    f = upload(client, batch_lines("e", 3))
    assert f.expires_at is None  # no policy: kept until deleted
    b = client.batches.create(
        input_file_id=f.id,
        endpoint=ENDPOINT,
        completion_window="24h",
        output_expires_after={"anchor": "created_at", "seconds": 7200},
    )
    finish_run(store, b.model_extra["canvasq"]["run_id"], errored=1)
    b = poll(client, b.id, deadline_s=60, server=srv)
    assert b.status == "completed" and b.output_file_id and b.error_file_id
    for fid in (b.output_file_id, b.error_file_id):
        out = client.files.retrieve(fid)
        assert out.expires_at == out.created_at + 7200, out
    assert client.files.retrieve(f.id).expires_at is None  # the input is not an output
    path = _path(store, files_dir, b.output_file_id)
    assert path.exists()

    _age(store, b.output_file_id)
    with pytest.raises(openai.NotFoundError):  # gone at once for every route, before the deletion
        client.files.retrieve(b.output_file_id)
    with pytest.raises(openai.NotFoundError):
        client.files.content(b.output_file_id)
    assert b.output_file_id not in {x.id for x in client.files.list()}
    end = time.monotonic() + 30
    while path.exists() and time.monotonic() < end:  # the finalizer's next passes delete row and bytes
        time.sleep(0.1)
    assert not path.exists(), srv.log()
    with store.Session() as s:
        assert s.scalar(select(ApiFile).where(ApiFile.id == b.output_file_id)) is None
        assert s.scalar(select(ApiFile).where(ApiFile.id == b.error_file_id)) is not None  # not yet due
    assert client.files.content(b.error_file_id).text.count("\n") == 1


def test_upload_expires_after_and_bad_policies(served):
    client, store, _, _ = served
    f = client.files.create(
        file=("in.jsonl", batch_lines("u", 2)),
        purpose="batch",
        expires_after={"anchor": "created_at", "seconds": 3600},
    )
    assert f.expires_at == f.created_at + 3600
    assert client.files.retrieve(f.id).expires_at == f.expires_at
    for bad in ({"anchor": "created_at", "seconds": 60}, {"anchor": "last_active_at", "seconds": 3600}):
        with pytest.raises(openai.BadRequestError, match="expires_after"):
            client.files.create(file=("in.jsonl", batch_lines("u", 2)), purpose="batch", expires_after=bad)
        with pytest.raises(openai.BadRequestError, match="output_expires_after"):
            client.batches.create(
                input_file_id=f.id, endpoint=ENDPOINT, completion_window="24h", output_expires_after=bad
            )
    _age(store, f.id)
    with pytest.raises(openai.NotFoundError):  # an expired input cannot start a batch
        client.batches.create(input_file_id=f.id, endpoint=ENDPOINT, completion_window="24h")
