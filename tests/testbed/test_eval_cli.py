"""`canvasq eval` on the committed testbed: every decoder goes through `run_batch`."""

import json

from click.testing import CliRunner

from canvasq.cli import cli


def _eval(*args):
    res = CliRunner().invoke(cli, ["eval", *args, "--json"])
    assert res.exit_code == 0, res.output
    return json.loads(res.output.strip().splitlines()[-1])


def test_eval_official_and_entropy_bound():
    d = _eval("--task", "code", "--n", "4", "--seed", "3", "--batch", "4")
    assert d["decoder"] == "official" and d["n"] == 4
    assert d["accuracy"] >= 0.5  # the trained testbed solves ~99 % of code problems
    assert d["forwards"] > 0 and d["tokens"] > 0
    bounded = _eval("--task", "code", "--n", "4", "--seed", "3", "--batch", "4", "--entropy-bound", "16")
    assert bounded["forwards"] <= d["forwards"]  # a looser bound accepts more per step


def test_eval_step_decoder_and_bad_flag():
    d = _eval("--task", "code", "--n", "2", "--seed", "3", "--decoder", "funnel", "--batch", "2")
    assert d["decoder"] == "funnel" and 0.0 <= d["accuracy"] <= 1.0 and d["forwards"] > 0
    res = CliRunner().invoke(
        cli, ["eval", "--task", "code", "--n", "1", "--decoder", "pipe", "--entropy-bound", "1"]
    )
    assert res.exit_code != 0 and "official decoder only" in res.output
