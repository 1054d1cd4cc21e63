"""Confidence-driven behaviour on the trained testbed checkpoint (skipped until it is committed):
EOS priority and commit-agree move in the directions Part 3 documents."""

import pytest
from helpers import TESTBED_DIR, trained_testbed

from canvasq.decoders import DecodeBatch, DecodeRequest, run_batch

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not trained_testbed(), reason="needs the trained testbed checkpoint (models/testbed)"),
]


@pytest.fixture(scope="module")
def bundle():
    from canvasq.model.loading import load_bundle

    return load_bundle(str(TESTBED_DIR))


def _batch(bundle, task, n=8, seed=11, max_tokens=96):
    from canvasq.testbed import tasks

    problems = tasks.generate(task, n, seed)
    reqs = [DecodeRequest(p.uid, bundle.encode_prompt(p.prompt, task), max_tokens, task) for p in problems]
    return DecodeBatch(reqs, seed=seed)


def test_seeded_runs_repeat_on_the_testbed(bundle):
    batch = _batch(bundle, "arith", n=4)
    for name in ("official", "pipe", "funnel"):
        a = run_batch(bundle, batch, decoder=name)
        b = run_batch(bundle, batch, decoder=name)
        assert [r.token_ids for r in a] == [r.token_ids for r in b], name
        assert all(r.error is None for r in a)


def test_eos_priority_commits_stop_tokens_earlier(bundle):
    batch = _batch(bundle, "code")
    # the trained testbed is confident about EOS: only a very high ordinary bar leaves room below it
    knobs = {"tau_conf": 0.9999}
    plain = run_batch(bundle, batch, decoder="pipe", overrides=knobs)
    eos = run_batch(bundle, batch, decoder="pipe", overrides={**knobs, "tau_eos": 0.3})
    assert sum(r.stats.get("eos_priority", 0) for r in eos) >= 1
    assert sum(r.forwards for r in eos) <= sum(r.forwards for r in plain)
    assert sum(len(r.token_ids) for r in eos) <= sum(len(r.token_ids) for r in plain)
    streak = run_batch(bundle, batch, decoder="pipe", overrides={**knobs, "tau_eos": 0.3, "eos_streak": True})
    # the stricter variant needs two argmax-EOS steps: it cannot fire more often than the plain one
    assert sum(r.stats.get("eos_priority", 0) for r in streak) <= sum(
        r.stats.get("eos_priority", 0) for r in eos
    )


def test_agree_mode_delays_commits(bundle):
    batch = _batch(bundle, "arith")
    plain = run_batch(bundle, batch, decoder="funnel")
    agree = run_batch(bundle, batch, decoder="funnel", overrides={"agree": True})
    assert sum(r.stats.get("agree_blocked", 0) for r in agree) >= 1
    assert sum(r.forwards for r in agree) >= sum(r.forwards for r in plain)


def test_lower_tau_conf_commits_more_per_forward(bundle):
    batch = _batch(bundle, "arith")
    tok_fwd = []
    for tau in (0.95, 0.6):
        res = run_batch(bundle, batch, decoder="pipe", overrides={"tau_conf": tau})
        tok_fwd.append(sum(len(r.token_ids) for r in res) / sum(r.forwards for r in res))
    assert tok_fwd[1] >= tok_fwd[0]
