"""`canvasq config` shows the device and experts settings with what they resolve to here;
`canvasq pack` writes the packed-experts cache a worker reads at start, once."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

from canvasq.cli import cli
from canvasq.core.settings import REPO_ROOT, reload_settings
from canvasq.model.loading import w4_cache_path

TESTBED = REPO_ROOT / "models" / "testbed"


@pytest.fixture
def env(monkeypatch, tmp_path):
    monkeypatch.setenv("CANVASQ_DATABASE_URL", f"sqlite:///{tmp_path / 'c.sqlite'}")
    for var in ("CANVASQ_DEVICE", "CANVASQ_EXPERTS", "CANVASQ_W4_CACHE_DIR"):
        monkeypatch.delenv(var, raising=False)
    reload_settings()
    yield monkeypatch
    reload_settings()


def _config(env, **variables):
    for k, v in variables.items():
        env.setenv(k, v)
    reload_settings()
    return CliRunner().invoke(cli, ["config"])


def test_config_shows_experts_and_device_resolved(env):
    here = "cuda:" if torch.cuda.is_available() else "cpu"
    res = _config(env)
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert any(x.startswith(f"device = auto (resolved: {here}") for x in lines)
    want = "w4" if torch.cuda.is_available() else "bf16"
    assert f"experts = auto (resolved: {want})" in lines
    assert "w4_cache_dir = None" in lines
    res = _config(env, CANVASQ_EXPERTS="w4", CANVASQ_DEVICE="cpu")
    assert "experts = w4 (resolved: w4)" in res.output.splitlines()


@pytest.mark.skipif(torch.cuda.device_count() > 7, reason="needs fewer than 8 visible GPUs")
def test_config_refuses_an_invisible_gpu_in_one_line(env):
    res = _config(env, CANVASQ_DEVICE="cuda:7")
    assert res.exit_code != 0
    err = res.output.strip().splitlines()
    assert len(err) == 1 and "CANVASQ_DEVICE=cuda:7" in err[0] and "visible" in err[0]


def test_pack_writes_the_cache_once(env, tmp_path):
    cache = tmp_path / "w4"
    res = CliRunner().invoke(cli, ["pack", str(TESTBED), "--device", "cpu", "--cache-dir", str(cache)])
    assert res.exit_code == 0, res.output
    path = w4_cache_path(TESTBED, torch.bfloat16, cache)
    assert path.is_file() and path.stat().st_size > 0
    assert f"packed {TESTBED} on cpu" in res.output and str(path) in res.output and "GiB" in res.output
    stamp = path.stat().st_mtime_ns
    again = CliRunner().invoke(cli, ["pack", str(TESTBED), "--device", "cpu", "--cache-dir", str(cache)])
    assert again.exit_code == 0 and again.output.startswith(f"already packed: {path}")
    assert path.stat().st_mtime_ns == stamp
    # the cache dir setting is the default of --cache-dir
    env.setenv("CANVASQ_W4_CACHE_DIR", str(cache))
    reload_settings()
    same = CliRunner().invoke(cli, ["pack", str(TESTBED), "--device", "cpu"])
    assert same.output.startswith(f"already packed: {path}")


def test_pack_refuses_what_it_cannot_pack(env, tmp_path):
    for args, needle in ((["random:26b-a4b"], "random weights"), ([str(tmp_path)], "no model at")):
        res = CliRunner().invoke(cli, ["pack", *args, "--device", "cpu"])
        assert res.exit_code != 0 and needle in res.output and len(res.output.strip().splitlines()) == 1
