"""Every bad-input class of RELIABILITY.md: `canvasq submit` exits 2, names each error with its line
number, and neither the store nor the real Redis queue receives anything. A control submission of
a good file through the same path proves the two "nothing" checks can see something."""

from __future__ import annotations

import json
import re
import tracemalloc
from pathlib import Path

import pytest
from click.testing import CliRunner

from canvasq.cli import cli
from canvasq.core.schemas import Limits, validate_file
from canvasq.core.settings import REPO_ROOT, Settings, reload_settings
from canvasq.core.store import Store
from tests.harness.backends import queue_length

BAD = Path(__file__).resolve().parents[1] / "data" / "bad_inputs"
EXPECTED = json.loads((BAD / "expected.json").read_text())


def _runs_in_store(db: Path) -> int:
    if not db.exists():
        return 0
    st = Store(f"sqlite:///{db}")
    try:
        return len(st.list_runs(limit=1000))
    except Exception:  # noqa: BLE001 - no tables: nothing was stored
        return 0
    finally:
        st.dispose()


def test_there_are_at_least_30_bad_input_files():
    files = sorted(p.name for p in BAD.glob("*.jsonl"))
    assert len(files) >= 30
    assert set(files) == set(EXPECTED), "every file needs an expectation and vice versa"


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_bad_input_rejected_with_line_numbers_and_nothing_enqueued(name, service_env, monkeypatch):
    spec = EXPECTED[name]
    for k, v in spec["env"].items():
        monkeypatch.setenv(k, v)
    reload_settings()
    res = CliRunner().invoke(cli, ["submit", str(BAD / name), "--queue", service_env["queue"]])
    assert res.exit_code == 2, res.output
    err = res.stderr
    reported = re.findall(r"^  line (\d+): (.*)$", err, flags=re.MULTILINE)
    reported += [("0", m) for m in re.findall(r"^  (file is empty.*)$", err, flags=re.MULTILINE)]
    for line, sub in spec["errors"]:
        assert any(int(n) == line and sub in msg for n, msg in reported), (
            f"missing line {line}: {sub!r} in\n{err}"
        )
    assert len(reported) == len(spec["errors"]), f"unexpected extra errors:\n{err}"
    assert "nothing was enqueued" in err
    assert queue_length(service_env["queue"]) == 0
    assert _runs_in_store(service_env["db"]) == 0


def test_control_good_file_is_stored_and_enqueued(service_env):
    """The same path with a valid file does store a run and publish messages."""
    res = CliRunner().invoke(
        cli,
        [
            "submit",
            str(REPO_ROOT / "examples" / "prompts.jsonl"),
            "--queue",
            service_env["queue"],
            "--chunk-size",
            "5",
        ],
    )
    assert res.exit_code == 0, res.output + res.stderr
    assert res.stdout.strip().startswith("run_")
    assert queue_length(service_env["queue"]) == 5  # 24 requests / 5 per chunk
    assert _runs_in_store(service_env["db"]) == 1


def _write_big_file(path: Path, n: int, bad_lines: dict[int, str]) -> None:
    with open(path, "w") as fh:
        for i in range(1, n + 1):
            if i in bad_lines:
                fh.write(bad_lines[i] + "\n")
            else:
                prompt = (
                    f"Ann has {i} apples. She finds 3 more apples. How many apples does Ann have now? " * 4
                )
                fh.write(
                    json.dumps({"custom_id": f"r{i}", "prompt": prompt, "task": "math", "max_tokens": 64})
                    + "\n"
                )


def test_100k_line_file_streams_in_bounded_memory(tmp_path):
    """A 100,000-line file (~40 MB) is validated without holding it: peak traced memory (the set of
    custom_ids and one line) stays below half the file size, and errors near the end are still
    found with their line numbers. Reading the whole file at once would exceed the bound."""
    path = tmp_path / "big.jsonl"
    _write_big_file(
        path, 100_000, {99_999: "{broken", 100_000: json.dumps({"custom_id": "r5", "prompt": "x"})}
    )
    size = path.stat().st_size
    assert size > 35_000_000
    limits = Limits.for_model(Settings())
    tracemalloc.start()
    try:
        report = validate_file(path, limits)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert report.lines == 100_000
    assert [(e.line, e.message.split(":")[0]) for e in report.errors] == [
        (99_999, "malformed JSON"),
        (100_000, "duplicate custom_id 'r5' (first on line 5)"),
    ]
    assert peak < size / 2, f"peak {peak} bytes for a {size}-byte file"


def test_error_list_is_capped_but_counted(tmp_path):
    path = tmp_path / "many.jsonl"
    path.write_text("nope\n" * 1000)
    limits = Limits.for_model(Settings(max_errors=50))
    report = validate_file(path, limits)
    assert len(report.errors) == 50 and report.errors_dropped == 950 and report.error_count == 1000
    assert "and 950 more" in report.summary()
