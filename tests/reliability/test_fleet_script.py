"""scripts/fleet.py, the multi-GPU fleet measurement, as a dry run on the CPU: two worker processes
drain one run through a private Redis and a SQLite store; one is SIGKILLed a third of the way
through; the other finishes the run with every custom_id exactly once. The workers claim chunks
ahead (CANVASQ_CLAIM_AHEAD=on, as GPU workers do by default), so the one killed may hold several."""

import json
import os
import subprocess
import sys

from canvasq.core.settings import REPO_ROOT


def test_fleet_dry_run_two_cpu_workers_one_killed(tmp_path):
    out = tmp_path / "fleet.json"
    res = subprocess.run(
        [
            sys.executable,
            str(REPO_ROOT / "scripts" / "fleet.py"),
            "--cpu",
            "2",
            "--requests",
            "48",
            "--max-tokens",
            "64",
            "--chunk-size",
            "2",
            "--scaling",
            "2",
            "--kill-one",
            "--lease-s",
            "10",
            "--visibility-timeout",
            "300",
            "--deadline-s",
            "400",
            "--claim-ahead",
            "on",
            "--json-out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
        # each feed of rows waits 0.3 s: the run lasts long enough that a poll sees it a third done
        # (unslowed, 48 rows can finish in ~5 s, faster than a loaded machine's polls see the third)
        env={**os.environ, "CANVASQ_TEST_DELAY_S": "0.3"},
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    rep = json.loads(out.read_text())
    (run,) = rep["runs"]
    assert rep["device"] == "cpu" and run["workers"] == 2 and len(run["ready_s"]) == 2
    assert run["killed_at_s"] is not None, run  # the kill happened mid-run
    assert run["ok"] and run["lost"] == run["duplicated"] == 0 and run["statuses"] == {"done": 48}, run
    assert run["tokens"] > 0 and sum(run["tok_s_per_worker"].values()) > 0
