"""The official `openai` client, unmodified, against a real `canvasq serve` subprocess: real workers
on the testbed model (a `canvasq worker` over Redis and PostgreSQL, or `serve --with-worker` on
SQLite), access control between projects, and upload limits enforced while the body streams."""

from __future__ import annotations

import io
import json
import socket
import threading
import time
from collections import Counter

import openai
import pytest
from openai import OpenAI

from tests.harness.backends import REDIS_URL, drop_queue, fresh_pg_database, unique_queue
from tests.harness.server import (
    ENDPOINT,
    ServerProcess,
    batch_lines,
    cli,
    free_port,
    poll,
    rss_bytes,
    upload,
)
from tests.harness.workers import WorkerProcess, worker_env

N_LINES = 64  # the main batch: 4 chunks of 16 (200 lines took ~50 s more of CI's CPU for no other path)


def jsonl(text: str) -> list[dict]:
    return [json.loads(x) for x in text.splitlines() if x.strip()]


def joined(client: OpenAI, b, ids: list[str]) -> tuple[list[dict], list[dict]]:
    """Output and error lines; together they name every custom_id of the input exactly once."""
    out = jsonl(client.files.content(b.output_file_id).text) if b.output_file_id else []
    err = jsonl(client.files.content(b.error_file_id).text) if b.error_file_id else []
    seen = Counter(line["custom_id"] for line in out + err)
    assert set(seen) == set(ids), (set(ids) - set(seen), set(seen) - set(ids))
    assert max(seen.values()) == 1, [k for k, v in seen.items() if v > 1]
    for line in out:
        assert line["error"] is None and line["response"]["status_code"] == 200
        assert isinstance(line["response"]["body"]["choices"][0]["message"]["content"], str)
    for line in err:
        assert line["response"] is None and line["error"]["code"]
    return out, err


def new_key(env: dict, project: str) -> str:
    return cli(env, "keys", "create", "--project", project).stdout.strip()


def metric(url: str, name: str, **labels: str) -> float:
    """The sum of a Prometheus text-format sample over the series whose labels include `labels`."""
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    total, found = 0.0, False
    for line in text.splitlines():
        head, _, value = line.rpartition(" ")
        series, _, tail = head.partition("{")
        if series == name and all(f'{k}="{v}"' in tail for k, v in labels.items()):
            total, found = total + float(value), True
    assert found, f"{name} {labels} not in {url}:\n{text[:3000]}"
    return total


def check_metrics(server, worker_port: int, during: float) -> None:
    """`/metrics` of the worker moved while the batch ran; the server's shows the fleet from the store."""
    worker = f"http://127.0.0.1:{worker_port}/metrics"
    after = metric(worker, "canvasq_worker_committed_tokens_total")
    assert after > during > 0
    assert metric(worker, "canvasq_worker_requests_total", status="done") >= N_LINES
    assert metric(worker, "canvasq_worker_slot_steps_busy_total") > 0
    assert metric(worker, "canvasq_worker_window_rows_total") > 0
    assert metric(worker, "canvasq_worker_info", device="cpu") == 1
    assert metric(worker, "canvasq_worker_forwards_total") > after  # several passes per committed token
    assert metric(server.url + "/metrics", "canvasq_committed_tokens_total") >= after
    assert (
        metric(
            server.url + "/metrics",
            "canvasq_http_requests_total",
            route="/v1/batches/{batch_id}",
            status="200",
        )
        > 0
    )
    assert metric(server.url + "/metrics", "canvasq_workers_online") >= 1


def full_flow(client: OpenAI, server, n: int, worker_port: int | None = None) -> None:
    """Upload, create, poll to completed, join; then a second batch cancelled mid-way."""
    ids = [f"main-{i}" for i in range(n)]
    f = upload(client, batch_lines("main", n))
    assert (f.object, f.purpose, f.bytes) == ("file", "batch", len(batch_lines("main", n)))
    assert client.files.retrieve(f.id).id == f.id
    assert client.files.content(f.id).content == batch_lines("main", n)
    b = client.batches.create(
        input_file_id=f.id, endpoint=ENDPOINT, completion_window="24h", metadata={"purpose": "test"}
    )
    assert b.status in ("in_progress", "validating") and b.request_counts.total == n
    assert b.metadata == {"purpose": "test"} and b.in_progress_at and b.expires_at
    end = time.monotonic() + 180
    while client.batches.retrieve(b.id).request_counts.completed < 1:
        assert time.monotonic() < end, server.log()
        time.sleep(0.3)
    during = metric(f"http://127.0.0.1:{worker_port}/metrics", "canvasq_worker_committed_tokens_total")
    b = poll(client, b.id, server=server)
    assert b.status == "completed", b
    assert b.request_counts.completed == n and b.request_counts.failed == 0
    assert b.completed_at and b.finalizing_at and b.output_file_id and b.error_file_id is None
    out, err = joined(client, b, ids)
    assert len(out) == n and not err
    assert b.usage.output_tokens == sum(x["response"]["body"]["usage"]["completion_tokens"] for x in out) > 0
    progress = b.model_extra["canvasq"]["progress"]  # the token-progress extension, kept by the stock client
    assert progress["completion_tokens"] == b.usage.output_tokens and progress["forwards"] > 0
    assert client.files.retrieve(b.output_file_id).purpose == "batch_output"
    check_metrics(server, worker_port, during)

    # cancelled mid-way: the rows finished before the cancel are kept, the rest are batch_cancelled
    m = 96
    f2 = upload(client, batch_lines("cx", m))
    b2 = client.batches.create(input_file_id=f2.id, endpoint=ENDPOINT, completion_window="24h")
    end = time.monotonic() + 180
    while client.batches.retrieve(b2.id).request_counts.completed < 3:
        assert time.monotonic() < end, server.log()
        time.sleep(0.3)
    c = client.batches.cancel(b2.id)
    assert c.status in ("cancelling", "cancelled") and c.cancelling_at
    b2 = poll(client, b2.id, until=("cancelled",), deadline_s=120, server=server)
    assert b2.cancelled_at and 3 <= b2.request_counts.completed < m
    out2, err2 = joined(client, b2, [f"cx-{i}" for i in range(m)])
    assert len(out2) == b2.request_counts.completed and len(err2) == m - len(out2)
    assert {e["error"]["code"] for e in err2} == {"batch_cancelled"}
    with pytest.raises(openai.ConflictError):  # a finished batch cannot be cancelled
        client.batches.cancel(b.id)
    listed = [x.id for x in client.batches.list(limit=1)]  # auto-paginated with after=
    assert listed[:2] == [b2.id, b.id]


def test_fleet_postgresql_redis(tmp_path):
    """`canvasq serve` publishing to Redis, a real `canvasq worker` on the testbed model, PostgreSQL."""
    prefix = unique_queue("cqapi")
    queue = f"{prefix}.{'testbed'}"
    with fresh_pg_database() as url:
        port = free_port()
        env = worker_env(
            db_url=url,
            broker_url=REDIS_URL,
            decode_batch_size=16,
            chunk_size=16,
            extra={"CANVASQ_QUEUE_PREFIX": prefix, "CANVASQ_FILES_DIR": str(tmp_path / "files")},
        )
        worker_env_ = {**env, "CANVASQ_METRICS_PORT": str(port)}
        cli(env, "db", "upgrade")
        key = new_key(env, "alpha")
        try:
            with (
                WorkerProcess(worker_env_, queue, tmp_path / "worker.log") as w,
                ServerProcess(env, tmp_path / "serve.log") as srv,
            ):
                srv.wait_ready()
                w.wait_ready()
                full_flow(OpenAI(base_url=srv.base_url, api_key=key, max_retries=0), srv, N_LINES, port)
        finally:
            drop_queue(queue)


def test_with_worker_sqlite(tmp_path):
    """`canvasq serve --with-worker` on SQLite (no broker used): the same flow, and an expired batch."""
    port = free_port()
    env = worker_env(
        db_url=f"sqlite:///{tmp_path / 'canvasq.sqlite'}",
        broker_url="redis://127.0.0.1:1/0",
        decode_batch_size=16,
        chunk_size=16,
        extra={"CANVASQ_FILES_DIR": str(tmp_path / "files"), "CANVASQ_METRICS_PORT": str(port)},
    )
    key = new_key(env, "alpha")
    with ServerProcess(env, tmp_path / "serve.log", with_worker=True) as srv:
        srv.wait_ready(deadline_s=180)
        client = OpenAI(base_url=srv.base_url, api_key=key, max_retries=0)
        full_flow(client, srv, N_LINES, port)
        # a window shorter than the work: rows not done in time are batch_expired
        n = 64
        b = client.batches.create(
            input_file_id=upload(client, batch_lines("ex", n)).id, endpoint=ENDPOINT, completion_window="3s"
        )
        b = poll(client, b.id, deadline_s=120, server=srv)
        assert b.status == "expired" and b.expired_at, b
        out, err = joined(client, b, [f"ex-{i}" for i in range(n)])
        assert err and {e["error"]["code"] for e in err} == {"batch_expired"}
        assert b.request_counts.completed == len(out) < n


# ---------------------------------------------------------------------------------------- no worker


@pytest.fixture
def api(tmp_path):
    """A server on SQLite that publishes to a Redis queue nobody consumes; two projects' keys."""
    queue_prefix = unique_queue("cqapi")
    env = worker_env(
        db_url=f"sqlite:///{tmp_path / 'canvasq.sqlite'}",
        broker_url=REDIS_URL,
        extra={
            "CANVASQ_QUEUE_PREFIX": queue_prefix,
            "CANVASQ_FILES_DIR": str(tmp_path / "files"),
            "CANVASQ_MAX_UPLOAD_BYTES": str(1 << 20),
            "CANVASQ_MAX_UPLOAD_LINES": "300",
            "CANVASQ_MAX_LINE_BYTES": "4096",
        },
    )
    keys = {p: new_key(env, p) for p in ("alpha", "beta")}
    with ServerProcess(env, tmp_path / "serve.log") as srv:
        srv.wait_ready()
        yield srv, env, keys, tmp_path
    drop_queue(f"{queue_prefix}.testbed")


def test_keys_projects_401_404(api):
    srv, env, keys, _ = api
    a = OpenAI(base_url=srv.base_url, api_key=keys["alpha"], max_retries=0)
    b = OpenAI(base_url=srv.base_url, api_key=keys["beta"], max_retries=0)
    f = upload(a, batch_lines("k", 4))
    batch = a.batches.create(input_file_id=f.id, endpoint=ENDPOINT, completion_window="24h")
    # another project's ids do not exist for it
    for call in (
        lambda: b.files.retrieve(f.id),
        lambda: b.files.content(f.id),
        lambda: b.files.delete(f.id),
        lambda: b.batches.retrieve(batch.id),
        lambda: b.batches.cancel(batch.id),
        lambda: b.batches.create(input_file_id=f.id, endpoint=ENDPOINT, completion_window="24h"),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    assert list(b.batches.list()) == [] and list(b.files.list()) == []
    assert [x.id for x in a.batches.list()] == [batch.id]
    # no key, a wrong key, a revoked key: 401
    import httpx2 as httpx

    for headers in (
        {},
        {"Authorization": "Bearer cq-not-a-key"},
        {"Authorization": f"Basic {keys['alpha']}"},
    ):
        r = httpx.get(f"{srv.base_url}/batches", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] in ("missing_api_key", "invalid_api_key")
    with pytest.raises(openai.AuthenticationError):
        OpenAI(base_url=srv.base_url, api_key="cq-wrong", max_retries=0).batches.list()
    key_id = next(line.split()[0] for line in cli(env, "keys", "list").stdout.splitlines() if "beta" in line)
    cli(env, "keys", "revoke", key_id)
    with pytest.raises(openai.AuthenticationError):
        b.files.list()
    assert (
        "beta" not in cli(env, "keys", "list").stdout and "beta" in cli(env, "keys", "list", "--all").stdout
    )
    # keys are stored hashed: the token appears nowhere in the store
    raw = (api[3] / "canvasq.sqlite").read_bytes() + (api[3] / "canvasq.sqlite-wal").read_bytes()
    assert keys["alpha"].encode() not in raw and keys["alpha"][3:].encode() not in raw
    # delete: gone for its owner too
    assert a.files.delete(f.id).deleted
    with pytest.raises(openai.NotFoundError):
        a.files.retrieve(f.id)


def test_validation_errors_name_the_line(api):
    srv, _, keys, _ = api
    a = OpenAI(base_url=srv.base_url, api_key=keys["alpha"], max_retries=0)
    good = batch_lines("v", 2).decode().splitlines()
    bad = (
        "\n".join([good[0], "{not json", good[1], good[0], json.dumps({"custom_id": "z", "prompt": ""})])
        + "\n"
    )
    b = a.batches.create(input_file_id=upload(a, bad.encode()).id, endpoint=ENDPOINT, completion_window="24h")
    assert b.status == "failed" and b.failed_at and b.output_file_id is None
    by_line = {e.line: e for e in b.errors.data}
    assert set(by_line) == {2, 4, 5}
    assert by_line[2].code == "invalid_json_line" and by_line[4].code == "duplicate_custom_id"
    assert "prompt is empty" in by_line[5].message
    assert a.batches.retrieve(b.id).status == "failed"
    with pytest.raises(openai.BadRequestError, match="endpoint"):
        a.batches.create(
            input_file_id=upload(a, batch_lines("w", 1)).id,
            endpoint="/v1/embeddings",
            completion_window="24h",
        )
    with pytest.raises(openai.BadRequestError, match="decoder"):
        a.batches.create(
            input_file_id=upload(a, batch_lines("w", 1)).id,
            endpoint=ENDPOINT,
            completion_window="24h",
            extra_body={"decoder": "nope"},
        )


def test_list_paginates(api):
    srv, _, keys, _ = api
    a = OpenAI(base_url=srv.base_url, api_key=keys["alpha"], max_retries=0)
    f = upload(a, batch_lines("p", 2))
    made = [
        a.batches.create(input_file_id=f.id, endpoint=ENDPOINT, completion_window="24h").id for _ in range(5)
    ]
    page = a.batches.list(limit=2)
    assert [x.id for x in page.data] == made[::-1][:2] and page.has_more
    assert [x.id for x in a.batches.list(limit=2, after=made[3]).data] == [made[2], made[1]]
    assert [x.id for x in a.batches.list(limit=2)] == made[::-1]  # every page, through `after`
    assert [x.id for x in a.batches.list(limit=10, after=made[0]).data] == []
    files = [x.id for x in a.files.list(limit=1)]
    assert f.id in files


def _raw_upload(port: int, head_extra: str, body_chunks, read_timeout_s: float = 30.0) -> tuple[bytes, int]:
    """POST /v1/files over a raw socket, sending `body_chunks` from a thread until the server answers
    or closes; returns (the response head, bytes sent)."""
    s = socket.create_connection(("127.0.0.1", port))
    boundary = "cqboundary"
    pre = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="big.jsonl"\r\n'
        "Content-Type: application/jsonl\r\n\r\n"
    ).encode()
    head = (
        f"POST /v1/files HTTP/1.1\r\nHost: 127.0.0.1\r\n{head_extra}"
        f"Content-Type: multipart/form-data; boundary={boundary}\r\n\r\n"
    ).encode()
    sent = [0]
    stop = threading.Event()

    def send():
        try:
            s.sendall(head)
            for chunk in body_chunks(pre):
                if stop.is_set():
                    return
                s.sendall(chunk)
                sent[0] += len(chunk)
        except OSError:
            pass

    t = threading.Thread(target=send, daemon=True)
    t.start()
    s.settimeout(read_timeout_s)
    got = b""
    try:
        while b"\r\n\r\n" not in got:
            part = s.recv(65536)
            if not part:
                break
            got += part
    finally:
        stop.set()
        s.close()
        t.join(10)
    return got, sent[0]


def test_upload_limits_while_streaming(api):
    srv, _, keys, tmp = api
    auth = f"Authorization: Bearer {keys['alpha']}\r\n"
    a = OpenAI(base_url=srv.base_url, api_key=keys["alpha"], max_retries=0)
    upload(a, batch_lines("warm", 2))  # the upload path is loaded before memory is measured
    rss0 = rss_bytes(srv.pid)
    two_gb = 2 * 1024**3
    line = (json.dumps({"custom_id": "x", "prompt": "y" * 200}) + "\n").encode()

    def body(pre, total=two_gb):  # 2 GB of lines, made as they are sent
        yield pre
        block = line * (1024 * 1024 // len(line))
        n = 0
        while n < total:
            yield block
            n += len(block)

    # without a key: 401 before the body is read
    got, _ = _raw_upload(srv.port, f"Content-Length: {two_gb}\r\n", body)
    assert got.startswith(b"HTTP/1.1 401"), got[:200]
    # a declared 2 GB body: refused before any of it is read
    got, sent = _raw_upload(srv.port, f"{auth}Content-Length: {two_gb}\r\n", body)
    assert got.startswith(b"HTTP/1.1 413"), got[:200]

    # a chunked body (no length): refused at the first chunk past the 1 MiB limit
    def chunked(pre):
        for c in body(pre):
            yield f"{len(c):x}\r\n".encode() + c + b"\r\n"

    got, sent = _raw_upload(srv.port, f"{auth}Transfer-Encoding: chunked\r\n", chunked)
    assert got.startswith(b"HTTP/1.1 413"), got[:200]
    assert sent < 256 * 1024**2, sent  # it stopped the sender long before 2 GB
    assert rss_bytes(srv.pid) - rss0 < 64 * 1024**2
    # line limits: more than 300 lines, a line over 4096 bytes
    with pytest.raises(openai.APIStatusError) as e:
        upload(a, b"".join([line] * 301))
    assert e.value.status_code == 413 and "300 lines" in e.value.message
    with pytest.raises(openai.BadRequestError, match="line 2 is longer than 4096"):
        upload(a, line + b'{"custom_id": "' + b"x" * 5000 + b'"}\n')
    with pytest.raises(openai.BadRequestError, match="purpose"):
        a.files.create(file=("f.jsonl", io.BytesIO(line)), purpose="fine-tune")
    assert list((tmp / "files" / "tmp").iterdir()) == []  # nothing of the refused uploads is left
    assert [f.filename for f in a.files.list()] == ["batch.jsonl"]
