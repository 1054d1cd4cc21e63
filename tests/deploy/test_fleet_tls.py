"""The README's remote-worker broker URL works as written: Redis with TLS and a password, reached as
`rediss://:PASSWORD@HOST:PORT/0?ssl_cert_reqs=required&ssl_ca_certs=CA` by `canvasq submit` (kombu)
and by the workers' reconcile lock (redis-py); without the CA the certificate is refused, and
without the password Redis refuses. A real redis-server with a throwaway CA made by openssl."""

from __future__ import annotations

import shutil
import subprocess

import pytest
from click.testing import CliRunner

from canvasq.cli import cli
from canvasq.core.settings import REPO_ROOT, Settings, reload_settings
from tests.harness.services import free_port
from tests.harness.waiting import wait_for

pytestmark = pytest.mark.skipif(
    not (shutil.which("redis-server") and shutil.which("openssl")), reason="needs redis-server and openssl"
)
PASSWORD = "0f1e2d3c4b5a69788796a5b4"


def _openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture
def tls_redis(tmp_path):
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "1",
        "-subj",
        "/CN=canvasq test CA",
        cwd=tmp_path,
    )
    _openssl(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "server.key",
        "-out",
        "server.csr",
        "-subj",
        "/CN=localhost",
        cwd=tmp_path,
    )
    (tmp_path / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    _openssl(
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "server.pem",
        "-days",
        "1",
        "-extfile",
        "san.ext",
        cwd=tmp_path,
    )
    port = free_port()
    proc = subprocess.Popen(
        [
            "redis-server",
            "-",
            "--port",
            "0",
            "--tls-port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--tls-cert-file",
            "server.pem",
            "--tls-key-file",
            "server.key",
            "--tls-ca-cert-file",
            "ca.pem",
            "--tls-auth-clients",
            "no",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(tmp_path),
        ],
        cwd=tmp_path,
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    proc.stdin.write(f'requirepass "{PASSWORD}"\n'.encode())
    proc.stdin.close()
    ca = tmp_path / "ca.pem"
    url = f"rediss://:{PASSWORD}@127.0.0.1:{port}/0?ssl_cert_reqs=required&ssl_ca_certs={ca}"
    import redis

    wait_for(lambda: redis.Redis.from_url(url).ping(), "TLS redis up", 20)
    yield url
    proc.terminate()
    proc.wait(10)


def test_submit_and_reconcile_lock_over_tls_with_a_password(tls_redis, tmp_path, monkeypatch):
    import redis

    url = tls_redis
    monkeypatch.setenv("CANVASQ_DATABASE_URL", f"sqlite:///{tmp_path / 'c.sqlite'}")
    monkeypatch.setenv("CANVASQ_BROKER_URL", url)
    monkeypatch.chdir(tmp_path)
    reload_settings()
    try:
        res = CliRunner().invoke(
            cli,
            [
                "submit",
                str(REPO_ROOT / "examples" / "prompts.jsonl"),
                "--queue",
                "q.tls",
                "--chunk-size",
                "8",
            ],
            catch_exceptions=False,
        )
        assert res.exit_code == 0, res.output
        assert PASSWORD not in res.output
        client = redis.Redis.from_url(url)
        assert client.llen("q.tls") == 3
        from canvasq.worker.reconcile import _take_lock, lock_key

        settings = Settings()
        assert _take_lock(client, lock_key(settings), "w1", 5) and not _take_lock(
            client, lock_key(settings), "w2", 5
        )
        client.close()
    finally:
        monkeypatch.undo()
        reload_settings()

    no_ca = url.split("&ssl_ca_certs=")[0]  # the certificate cannot be verified: refused
    with pytest.raises(redis.exceptions.ConnectionError, match="(?i)certificate"):
        redis.Redis.from_url(no_ca).ping()
    no_pw = url.replace(f":{PASSWORD}@", "")
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis.from_url(no_pw).ping()
