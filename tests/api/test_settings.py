"""Settings from the environment, password masking, routing validation, time-limit ordering."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from pydantic import ValidationError

from canvasq.api.settings import DEFAULT_MODEL_DIR, Settings, mask_url, queue_name


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
    ],
)
def test_mask_url(url, masked):
    assert mask_url(url) == masked


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
    out = subprocess.run([sys.executable, "-m", "canvasq.api.cli", "config"], env=env, capture_output=True,
                         text=True, check=True).stdout
    assert "topsecret" not in out and "u:***@h/db" in out


def test_random_model_context_is_the_built_models():
    """The submit-side context limit of a `random:` model is the max_position_embeddings of the model
    `load_bundle` builds for it (it was 131,072 for 26b-a4b while the built config said 262,144)."""
    from canvasq.api.schemas import model_context
    from canvasq.model.shapes import real_config
    from canvasq.testbed.config import build_config

    assert model_context("random:26b-a4b")[0] == real_config().get_text_config().max_position_embeddings
    assert model_context("random:testbed")[0] == build_config().get_text_config().max_position_embeddings
