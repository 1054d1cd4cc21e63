"""docker-compose.yml keeps the reliability settings and is secure by default (no Docker daemon needed:
the file is read, its variables interpolated as compose does, and its Redis command run here)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from canvasq.core.settings import REPO_ROOT


def load():
    return yaml.safe_load((REPO_ROOT / "docker-compose.yml").read_text())


def test_redis_aof_and_noeviction():
    cmd = " ".join(load()["services"]["redis"]["command"])
    assert "--appendonly yes" in cmd and "--maxmemory-policy noeviction" in cmd


def test_migration_is_one_shot_and_gates_workers():
    svc = load()["services"]
    assert svc["migrate"]["command"] == ["canvasq", "db", "upgrade"] and svc["migrate"]["restart"] == "no"
    assert svc["worker"]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"


def test_workers_reserve_gpus_and_claim_one_each():
    w = load()["services"]["worker"]
    dev = w["deploy"]["resources"]["reservations"]["devices"][0]
    assert dev["driver"] == "nvidia" and "gpu" in dev["capabilities"]
    assert "--gpu" in w["command"] and w["command"][w["command"].index("--gpu") + 1] == "auto"
    assert "CANVASQ_GPU_SLOTS" in w["environment"]
    assert "replicas" not in w.get("deploy", {}), "replica count comes from --scale"
    env = w["environment"]
    assert int(env["CANVASQ_VISIBILITY_TIMEOUT"].split("-")[-1].rstrip("}")) > int(
        env["CANVASQ_HARD_TIME_LIMIT"].split("-")[-1].rstrip("}")
    )


# ------------------------------------------------------------------------ secure by default (issue 19)

_VAR = re.compile(r"\$\$|\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}")


class Refused(Exception):
    pass


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's interpolation: ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?err}, ${VAR?err}, $$."""

    def sub(m):
        if m[0] == "$$":
            return "$$"  # stays escaped: compose hands `$` to the container
        name, op, arg = m["name"], m["op"], m["arg"]
        value = env.get(name)
        unset = value is None or (op is not None and op.startswith(":") and value == "")
        if op in ("?", ":?") and unset:
            raise Refused(f"{name}: {arg}")
        if op in ("-", ":-") and unset:
            return arg
        return value or ""

    return _VAR.sub(sub, text)


def resolved(env: dict[str, str]) -> dict:
    return yaml.safe_load(interpolate((REPO_ROOT / "docker-compose.yml").read_text(), env))


PASSWORDS = {"REDIS_PASSWORD": "a1b2c3d4e5", "POSTGRES_PASSWORD": "f6a7b8c9d0"}


@pytest.mark.parametrize("missing", ["REDIS_PASSWORD", "POSTGRES_PASSWORD"])
def test_compose_refuses_to_start_without_each_password(missing):
    env = {k: v for k, v in PASSWORDS.items() if k != missing}
    with pytest.raises(Refused, match=missing):
        resolved(env)
    with pytest.raises(Refused, match=missing):
        resolved(env | {missing: ""})  # an empty password is no password
    text = (REPO_ROOT / "docker-compose.yml").read_text()
    assert not re.search(r"\$\{[A-Z_]*PASSWORD:?-", text), "a password with a default"
    assert "canvasq:canvasq@" not in text


def test_services_are_published_on_localhost_unless_told_otherwise():
    svc = resolved(PASSWORDS)["services"]
    published = {name: s["ports"] for name, s in svc.items() if s.get("ports")}
    assert set(published) == {"redis", "postgres"}, published
    for ports in published.values():
        assert all(p.startswith("127.0.0.1:") for p in ports), published
    wide = resolved(PASSWORDS | {"REDIS_BIND": "10.0.0.5", "POSTGRES_BIND": "10.0.0.5"})["services"]
    assert wide["redis"]["ports"] == ["10.0.0.5:6379:6379"] and wide["postgres"]["ports"] == [
        "10.0.0.5:5432:5432"
    ]


def test_services_use_the_passwords_and_workers_reconcile():
    svc = resolved(PASSWORDS)["services"]
    assert svc["postgres"]["environment"]["POSTGRES_PASSWORD"] == PASSWORDS["POSTGRES_PASSWORD"]
    env = svc["worker"]["environment"]
    assert env["CANVASQ_BROKER_URL"] == f"redis://:{PASSWORDS['REDIS_PASSWORD']}@redis:6379/0"
    assert env["PGPASSWORD"] == PASSWORDS["POSTGRES_PASSWORD"] and "@postgres" in env["CANVASQ_DATABASE_URL"]
    assert ":" not in env["CANVASQ_DATABASE_URL"].split("://")[1].split("@")[0]  # no password in the URL
    assert "reconcile" not in svc and "CANVASQ_RECONCILE_S" not in env  # workers reconcile (the default)
    assert "REDISCLI_AUTH" in " ".join(svc["redis"]["healthcheck"]["test"])


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server not installed")
def test_redis_command_requires_the_password_and_hides_it(tmp_path):
    """The compose file's Redis command itself, run here (a stand-in for the image's entrypoint adds
    a free port and a scratch dir): it refuses to start without a password, then answers NOAUTH
    without it and PONG with it, and the password is on no command line."""
    from tests.harness.services import free_port

    port = free_port()
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "docker-entrypoint.sh").write_text(
        f'#!/bin/sh\nexec "$@" --port {port} --bind 127.0.0.1 --dir {tmp_path} --save ""\n'
    )
    (shim / "docker-entrypoint.sh").chmod(0o755)
    cmd = [c.replace("$$", "$") for c in resolved(PASSWORDS)["services"]["redis"]["command"]]
    base = {"PATH": f"{shim}:{os.environ['PATH']}"}
    refused = subprocess.run(
        cmd, env=base | {"REDIS_PASSWORD": ""}, capture_output=True, text=True, timeout=30, check=False
    )
    assert refused.returncode != 0 and "REDIS_PASSWORD must be set" in refused.stderr
    proc = subprocess.Popen(
        cmd,
        env=base | {"REDIS_PASSWORD": PASSWORDS["REDIS_PASSWORD"]},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        import redis

        from tests.harness.waiting import wait_for

        anon = redis.Redis(port=port)
        wait_for(lambda: _answers(anon), "redis up", 20)
        with pytest.raises(redis.exceptions.AuthenticationError):
            anon.ping()
        assert redis.Redis(port=port, password=PASSWORDS["REDIS_PASSWORD"]).ping()
        assert PASSWORDS["REDIS_PASSWORD"].encode() not in Path(f"/proc/{proc.pid}/cmdline").read_bytes()
        assert redis.Redis(port=port, password=PASSWORDS["REDIS_PASSWORD"]).config_get("appendonly") == {
            "appendonly": "yes"
        }
    finally:
        proc.terminate()
        proc.wait(10)


def _answers(client) -> bool:
    import redis

    try:
        client.ping()
    except redis.exceptions.AuthenticationError:
        return True
    except redis.exceptions.ConnectionError:
        return False
    return True
