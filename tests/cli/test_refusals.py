"""Issue 19, part 3: every bad input and misconfiguration ends as one clear line and a non-zero exit,
checked before any generation: no traceback, nothing stored, the output file untouched. Real
services: SQLite in tmp, the machine's PostgreSQL and Redis; closed ports are real closed ports."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from canvasq.cli import cli
from canvasq.core.settings import DEFAULT_MODEL_DIR, get_settings
from canvasq.core.store import Store
from tests.harness.backends import REDIS_URL, fresh_pg_database, queue_length
from tests.harness.services import free_port

OLD = "old results\n"


def _good(cid: str = "a", prompt: str = "What is 2 plus 2?") -> str:
    return json.dumps({"custom_id": cid, "prompt": prompt, "task": "math", "max_tokens": 4})


def _runs(url: str) -> int:
    if url.startswith("sqlite") and not Path(url.removeprefix("sqlite:///")).exists():
        return 0
    st = Store(url)
    try:
        return len(st.list_runs(limit=1000))
    except Exception:  # noqa: BLE001 - no tables: nothing was stored
        return 0
    finally:
        st.dispose()


@pytest.fixture
def env(tmp_path, monkeypatch):
    """A SQLite store and the real Redis; an output file holding old results that must survive."""
    db = f"sqlite:///{tmp_path / 'canvasq.sqlite'}"
    monkeypatch.setenv("CANVASQ_DATABASE_URL", db)
    monkeypatch.setenv("CANVASQ_BROKER_URL", REDIS_URL)
    monkeypatch.chdir(tmp_path)
    get_settings.cache_clear()
    out = tmp_path / "out.jsonl"
    out.write_text(OLD)
    yield {"tmp": tmp_path, "db": db, "out": out, "mp": monkeypatch}
    monkeypatch.undo()
    get_settings.cache_clear()


def refused(args: list[str], *, code: int | None = None) -> str:
    """Invoke the CLI; assert a clean refusal (SystemExit, non-zero, no traceback); return stderr."""
    get_settings.cache_clear()
    res = CliRunner().invoke(cli, args)
    assert res.exit_code != 0, res.output + res.stderr
    assert isinstance(res.exception, SystemExit), f"not a clean exit: {res.exception!r}\n{res.stderr}"
    assert "Traceback" not in res.stderr
    if code is not None:
        assert res.exit_code == code, res.stderr
    return res.stderr


def _one_error_line(err: str) -> str:
    lines = [x for x in err.splitlines() if x.startswith("Error:")]
    assert len(lines) == 1, err
    return lines[0]


# ---------------------------------------------------------------------------------------- input lines


@pytest.mark.parametrize(
    "bad_line, expected",
    [
        ('{"custom_id": "d", "prompt": ' + "[" * 10_000 + "]" * 10_000 + "}", "JSON nested too deeply"),
        ('{"custom_id": "x\\ud800", "prompt": "hi"}', "custom_id contains a lone surrogate (\\ud800"),
        ('{"custom_id": "s", "prompt": "hi \\udfff there"}', "prompt contains a lone surrogate (\\udfff"),
        (
            (
                '{"custom_id": "s", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": '
                '[{"role": "user", "content": "a\\ud800"}]}}'
            ),
            "prompt contains a lone surrogate",
        ),
        (
            '{"custom_id": "n", "prompt": "a\\u0000b"}',
            "prompt contains a NUL character (\\u0000 at character 2)",
        ),
    ],
)
def test_bad_line_named_with_its_number_nothing_stored(env, bad_line, expected):
    path = env["tmp"] / "in.jsonl"
    path.write_text(_good("a") + "\n" + bad_line + "\n" + _good("c") + "\n")
    err = refused(["run", str(path), "-o", str(env["out"])], code=2)
    assert f"line 2: {expected}" in err, err
    assert "line 1" not in err and "line 3" not in err
    assert _runs(env["db"]) == 0 and env["out"].read_text() == OLD


def test_raw_nul_reported_on_its_own_line(env):
    path = env["tmp"] / "in.jsonl"
    path.write_bytes(
        (_good("a") + "\n" + _good("b") + "\n").encode() + b'{"custom_id": "c", "prompt": "x\0y"}\n'
    )
    err = refused(["run", str(path), "-o", str(env["out"])], code=2)
    assert "line 3: binary data (NUL byte" in err and "line 1" not in err
    assert _runs(env["db"]) == 0 and env["out"].read_text() == OLD


def test_fifo_input_refused_without_blocking(env):
    fifo = env["tmp"] / "in.jsonl"
    os.mkfifo(fifo)
    err = refused(["run", str(fifo), "-o", str(env["out"])], code=2)
    assert "is a FIFO; the input must be a regular file" in err
    assert _runs(env["db"]) == 0 and env["out"].read_text() == OLD


def test_escaped_nul_and_surrogate_refused_on_postgresql(env):
    """The lines PostgreSQL cannot hold (text with NUL) are refused before the store sees them."""
    with fresh_pg_database() as url:
        env["mp"].setenv("CANVASQ_DATABASE_URL", url)
        Store(url).upgrade()
        path = env["tmp"] / "in.jsonl"
        path.write_text(
            _good("a")
            + "\n"
            + json.dumps({"custom_id": "b\u0000", "prompt": "x"})
            + "\n"
            + '{"custom_id": "c", "prompt": "secret prompt \\u0000"}\n'
        )
        err = refused(["submit", str(path), "--queue", "canvasq.test.never"], code=2)
        assert "line 2: custom_id contains a NUL" in err and "line 3: prompt contains a NUL" in err
        assert "secret prompt" not in err  # the prompt is never echoed
        assert _runs(url) == 0 and queue_length("canvasq.test.never") == 0


def test_long_names_on_postgresql(env):
    """--name / --queue / --key over the 200-character columns are refused; a file name over 200
    characters is a valid submission whose default name is cut to 200."""
    with fresh_pg_database() as url:
        env["mp"].setenv("CANVASQ_DATABASE_URL", url)
        Store(url).upgrade()
        path = env["tmp"] / ("f" * 230 + ".jsonl")
        path.write_text(_good() + "\n")
        for opt in ("--name", "--queue", "--key"):
            err = refused(["submit", str(path), opt, "n" * 201], code=2)
            assert f"Invalid value for '{opt}': 201 characters; the limit is 200" in err
        assert _runs(url) == 0
        queue = "canvasq.test.longname"
        get_settings.cache_clear()
        res = CliRunner().invoke(cli, ["submit", str(path), "--queue", queue])
        try:
            assert res.exit_code == 0, res.stderr
            st = Store(url)
            assert [r["name"] for r in st.list_runs()] == ["f" * 200]
            st.dispose()
        finally:
            from tests.harness.backends import drop_queue

            drop_queue(queue)


# ---------------------------------------------------------------------------------------- settings


def _corrupt_model(tmp: Path, how: str) -> Path:
    d = tmp / f"model_{how}"
    d.mkdir()
    for f in DEFAULT_MODEL_DIR.iterdir():
        (d / f.name).symlink_to(f)
    if how == "config":
        (d / "config.json").unlink()
        (d / "config.json").write_text("{not json")
    elif how == "truncated":
        shard = min(DEFAULT_MODEL_DIR.glob("*.safetensors"))
        (d / shard.name).unlink()
        (d / shard.name).write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    elif how == "garbage":
        shard = min(DEFAULT_MODEL_DIR.glob("*.safetensors"))
        (d / shard.name).unlink()
        (d / shard.name).write_bytes(b"\xff" * 4096)
    return d


@pytest.mark.parametrize(
    "case",
    [
        "missing_model",
        "config",
        "truncated",
        "garbage",
        "chunk_size",
        "routing",
        "routing_decoder",
        "mysql",
        "pg_closed_port",
        "pg_missing_host",
        "sqlite_missing_dir",
        "out_missing_dir",
        "dev_full",
        "proc",
        "out_is_input",
    ],
)
def test_misconfiguration_one_line_before_generation(env, case):
    path = env["tmp"] / "in.jsonl"
    path.write_text(_good() + "\n")
    mp, out = env["mp"], str(env["out"])
    expect = {
        "missing_model": "model directory /nonexistent/model does not exist",
        "config": "config.json is not valid JSON",
        "truncated": "is truncated",
        "garbage": "is not a safetensors file",
        "chunk_size": "bad setting CANVASQ_CHUNK_SIZE='0'",
        "routing": "bad setting CANVASQ_ROUTING: cannot parse its value",
        "routing_decoder": "bad setting CANVASQ_ROUTING",
        "mysql": "CANVASQ_DATABASE_URL: 'mysql' databases are not supported",
        "pg_closed_port": "cannot use the database CANVASQ_DATABASE_URL=postgresql+psycopg://u:***@127.0.0.1",
        "pg_missing_host": "cannot use the database CANVASQ_DATABASE_URL=postgresql+psycopg://u:***@no-such-host.invalid",
        "sqlite_missing_dir": "CANVASQ_DATABASE_URL: directory /nonexistent/dir does not exist",
        "out_missing_dir": "directory /nonexistent/dir does not exist",
        "dev_full": "-o /dev/full is not a regular file",
        "proc": "-o /proc/self/nope: cannot write in /proc/self",
        "out_is_input": "is the input file",
    }[case]
    if case == "missing_model":
        mp.setenv("CANVASQ_MODEL", "/nonexistent/model")
    elif case in ("config", "truncated", "garbage"):
        mp.setenv("CANVASQ_MODEL", str(_corrupt_model(env["tmp"], case)))
    elif case == "chunk_size":
        mp.setenv("CANVASQ_CHUNK_SIZE", "0")
    elif case == "routing":
        mp.setenv("CANVASQ_ROUTING", "{math: pipe")
    elif case == "routing_decoder":
        mp.setenv("CANVASQ_ROUTING", '{"math": "fastest"}')
    elif case == "mysql":
        mp.setenv("CANVASQ_DATABASE_URL", "mysql://u:secret@127.0.0.1/db")
    elif case == "pg_closed_port":
        mp.setenv("CANVASQ_DATABASE_URL", f"postgresql+psycopg://u:secret@127.0.0.1:{free_port()}/db")
    elif case == "pg_missing_host":
        mp.setenv("CANVASQ_DATABASE_URL", "postgresql+psycopg://u:secret@no-such-host.invalid/db")
    elif case == "sqlite_missing_dir":
        mp.setenv("CANVASQ_DATABASE_URL", "sqlite:////nonexistent/dir/canvasq.sqlite")
    elif case == "out_missing_dir":
        out = "/nonexistent/dir/out.jsonl"
    elif case == "dev_full":
        out = "/dev/full"
    elif case == "proc":
        out = "/proc/self/nope"
    elif case == "out_is_input":
        out = str(path)
    err = refused(["run", str(path), "-o", out])
    line = _one_error_line(err)
    assert expect in line, err
    assert "secret" not in err
    assert "generating" not in err and "loading" not in err  # refused before the model loads
    assert _runs(env["db"]) == 0 and env["out"].read_text() == OLD
    assert path.read_text() == _good() + "\n"
    assert not [p for p in env["tmp"].iterdir() if p.name.endswith(".tmp")]  # no temp file left behind


def test_model_that_fails_to_load_leaves_no_run(env):
    """A directory that passes the cheap checks but does not load (a config of another model type):
    the model loads before the run is created, so the store holds nothing."""
    d = _corrupt_model(env["tmp"], "ok")
    (d / "config.json").unlink()
    (d / "config.json").write_text(json.dumps({"model_type": "no_such_model_type"}))
    env["mp"].setenv("CANVASQ_MODEL", str(d))
    path = env["tmp"] / "in.jsonl"
    path.write_text(_good() + "\n")
    err = refused(["run", str(path), "-o", str(env["out"])])
    assert "cannot load the model" in _one_error_line(err)
    assert _runs(env["db"]) == 0 and env["out"].read_text() == OLD


@pytest.mark.parametrize("broker", ["closed_port", "missing_host"])
def test_submit_with_broker_down_stores_nothing(env, broker):
    url = (
        f"redis://:secret@127.0.0.1:{free_port()}/0"
        if broker == "closed_port"
        else "redis://:secret@no-such-host.invalid:6379/0"
    )
    env["mp"].setenv("CANVASQ_BROKER_URL", url)
    path = env["tmp"] / "in.jsonl"
    path.write_text(_good() + "\n")
    err = refused(["submit", str(path), "--queue", "canvasq.test.never"])
    assert "cannot reach the broker CANVASQ_BROKER_URL=redis://:***@" in _one_error_line(err)
    assert "secret" not in err
    assert _runs(env["db"]) == 0


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through directory permissions")
def test_read_only_sqlite_dir(env):
    ro = env["tmp"] / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    env["mp"].setenv("CANVASQ_DATABASE_URL", f"sqlite:///{ro / 'canvasq.sqlite'}")
    path = env["tmp"] / "in.jsonl"
    path.write_text(_good() + "\n")
    err = refused(["run", str(path), "-o", str(env["out"])])
    assert "is not writable" in _one_error_line(err)
    shutil.rmtree(ro, ignore_errors=True)


def test_worker_refuses_a_missing_model(env):
    env["mp"].setenv("CANVASQ_MODEL", "/nonexistent/model")
    err = refused(["worker", "--pool", "solo"])
    assert "model directory /nonexistent/model does not exist" in _one_error_line(err)
