"""Settings from the environment, password masking, routing validation, time-limit ordering."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from pydantic import ValidationError

from canvasq.core.settings import DEFAULT_MODEL_DIR, Settings, mask_url, queue_name


def test_defaults(monkeypatch):
    for k in list(os.environ):
        if k.startswith("CANVASQ_"):
            monkeypatch.delenv(k)
    s = Settings()
    assert s.database_url == "sqlite:///canvasq.sqlite"
    assert s.broker_url == "redis://localhost:6379/0"
    assert s.model == str(DEFAULT_MODEL_DIR) and DEFAULT_MODEL_DIR.is_absolute()
    assert DEFAULT_MODEL_DIR.parent.name == "models"
    s.check_time_limits()


def test_env_overrides(monkeypatch):
    monkeypatch.setenv("CANVASQ_DATABASE_URL", "postgresql+psycopg://u:pw@db:5432/canvasq")
    monkeypatch.setenv("CANVASQ_ROUTING", '{"math": "pipe", "code": "official"}')
    monkeypatch.setenv("CANVASQ_CHUNK_SIZE", "7")
    monkeypatch.setenv("CANVASQ_MAX_ATTEMPTS", "5")
    s = Settings()
    assert s.routing == {"math": "pipe", "code": "official"}
    assert (s.chunk_size, s.max_attempts) == (7, 5)
    assert "pw" not in str(s.describe()) and "u:***@db" in s.describe()["database_url"]


def test_bad_routing_rejected(monkeypatch):
    monkeypatch.setenv("CANVASQ_ROUTING", '{"math": "beam"}')
    with pytest.raises(ValidationError, match="beam"):
        Settings()


@pytest.mark.parametrize(
    "url, masked",
    [
        ("postgresql+psycopg://user:s3cr3t@host:5432/db", "postgresql+psycopg://user:***@host:5432/db"),
        ("redis://:hunter2@redis:6379/0", "redis://:***@redis:6379/0"),
        ("redis://localhost:6379/0", "redis://localhost:6379/0"),
        ("sqlite:///canvasq.sqlite", "sqlite:///canvasq.sqlite"),
        # an unencoded `@` (and `/`, `?`) inside the password: the userinfo ends at the last `@`
        ("redis://:p@ss@redis:6379/0", "redis://:***@redis:6379/0"),
        ("postgresql://u:a/b@c@h:5432/db?sslmode=require", "postgresql://u:***@h:5432/db?sslmode=require"),
        ("postgresql://u:pa?ss@h/db", "postgresql://u:***@h/db"),
        # secrets in query parameters
        ("redis://redis:6379/0?password=hunter2", "redis://redis:6379/0?password=***"),
        (
            "postgresql://u@h/db?sslmode=verify-full&sslpassword=kk&application_name=a@b",
            "postgresql://u@h/db?sslmode=verify-full&sslpassword=***&application_name=a@b",
        ),
        (
            "rediss://:pw@h:6380/0?ssl_cert_reqs=required&token=t0k",
            "rediss://:***@h:6380/0?ssl_cert_reqs=required&token=***",
        ),
        # URLs inside an error line, each masked; a username alone is not a secret
        (
            "Error 111 connecting to redis://:s3@cr3t@h:1/0; db postgresql://u:pw@h/d.",
            "Error 111 connecting to redis://:***@h:1/0; db postgresql://u:***@h/d.",
        ),
        ("postgresql://canvasq@postgres:5432/canvasq", "postgresql://canvasq@postgres:5432/canvasq"),
    ],
)
def test_mask_url(url, masked):
    assert mask_url(url) == masked


@pytest.mark.parametrize("secret", ["Pq7@Zx9", "Aa1/Bb2@Cc3", "Xx1?Yy2@Zz3", "Ss1@:/?Tt2#Uu3", "Hh4nter2"])
def test_mask_url_never_leaves_the_password(secret):
    urls = [f"redis://:{secret}@h:6379/0", f"postgresql+psycopg://u:{secret}@h/db?sslmode=require"]
    if "#" not in secret:  # in a query, `#` starts the fragment: not part of the value
        urls.append(f"redis://h:6379/0?password={secret}&db=1")
    for url in urls:
        out = mask_url(url)
        assert "***" in out and not any(part in out for part in re.findall(r"[A-Za-z0-9]+", secret)), (
            url,
            out,
        )


def test_lease_must_outlive_a_missed_heartbeat():
    s = Settings()
    assert (s.lease_s, s.heartbeat_s, s.reconcile_s, s.offline_after_s) == (60, 15.0, 15.0, 55.0)
    s.check_time_limits()
    with pytest.raises(ValueError, match="lease_s=30 is too short for heartbeat_s=15"):
        Settings(lease_s=30).check_time_limits()
    Settings(lease_s=9, heartbeat_s=2).check_time_limits()


@pytest.mark.parametrize("vis, hard, soft", [(100, 100, 50), (100, 200, 50), (300, 200, 200)])
def test_time_limit_order_enforced(vis, hard, soft):
    s = Settings(visibility_timeout=vis, hard_time_limit=hard, soft_time_limit=soft)
    with pytest.raises(ValueError, match="visibility_timeout > hard_time_limit > soft_time_limit"):
        s.check_time_limits()


def test_queue_per_model():
    assert queue_name("/x/models/testbed") == "canvasq.testbed"
    assert queue_name("random:26b-a4b") == "canvasq.random-26b-a4b"
    assert queue_name("/m/DiffusionGemma 26B/") == "canvasq.diffusiongemma-26b"


def test_config_command_masks_password():
    env = {**os.environ, "CANVASQ_DATABASE_URL": "postgresql+psycopg://u:topsecret@h/db"}
    out = subprocess.run(
        [sys.executable, "-m", "canvasq.cli", "config"], env=env, capture_output=True, text=True, check=True
    ).stdout
    assert "topsecret" not in out and "u:***@h/db" in out


def test_random_model_context_is_the_built_models():
    """The submit-side context limit of a `random:` model is the max_position_embeddings of the model
    `load_bundle` builds for it (it was 131,072 for 26b-a4b while the built config said 262,144)."""
    from canvasq.core.models import model_context
    from canvasq.model.shapes import REAL_26B_A4B, build_config

    for spec, cfg in (("random:26b-a4b", build_config(REAL_26B_A4B)), ("random:testbed", build_config())):
        ctx = model_context(spec)
        assert ctx.positions == cfg.get_text_config().max_position_embeddings
        assert ctx.canvas_length == cfg.canvas_length


def test_every_setting_declares_its_identity_flag():
    """An embedded run's identity is read off the fields (`run_identity`): a field without its flag
    would silently fall on one side, so each declares exactly one."""
    from canvasq.core.settings import Identity, identity_of

    for name, info in Settings.model_fields.items():
        assert sum(isinstance(m, Identity) for m in info.metadata) == 1, name
        identity_of(name)


def test_run_identity_holds_what_changes_tokens_only():
    from canvasq.core.settings import run_identity

    base = Settings(model="random:testbed")
    ident = run_identity(base)
    assert {
        "model",
        "seed",
        "routing",
        "routing_budget",
        "default_max_tokens",
        "device",
        "experts",
        "fp8",
        "fp8_min_rows",
        "decode_slots",
        "decode_batch_size",
        "cuda_graphs",
        "schema_in_prompt",
    } <= set(ident)
    for name, value in [
        ("lease_s", 90),
        ("reconcile_s", 5.0),
        ("heartbeat_s", 3.0),
        ("database_url", "sqlite://"),
        ("broker_url", "redis://x:1/0"),
        ("torch_threads", 3),
        ("max_attempts", 7),
        ("max_tokens_limit", 99),
        ("w4_cache_dir", "/tmp/w4"),
        ("chunk_size", 3),
    ]:
        assert run_identity(base.model_copy(update={name: value})) == ident, name
    for name, value in [
        ("seed", 1),
        ("fp8", "off"),
        ("experts", "w4"),
        ("default_max_tokens", 9),
        ("routing", {"math": "pipe"}),
        ("cuda_graphs", "off"),
        ("decode_slots", 4),
        ("schema_in_prompt", False),
    ]:
        assert run_identity(base.model_copy(update={name: value})) != ident, name


def test_run_identity_resolves_a_model_directory(tmp_path, monkeypatch):
    from canvasq.core.settings import run_identity

    (tmp_path / "m").mkdir()
    monkeypatch.chdir(tmp_path)
    assert run_identity(Settings(model="m")) == run_identity(Settings(model=str(tmp_path / "m")))
