"""docker-compose.yml keeps the reliability settings (no Docker daemon needed to check them)."""

from __future__ import annotations

import yaml

from canvasq.api.settings import REPO_ROOT


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
        env["CANVASQ_HARD_TIME_LIMIT"].split("-")[-1].rstrip("}"))
