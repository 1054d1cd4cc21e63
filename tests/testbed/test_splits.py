"""Splits by purpose: train, dev and eval disjoint by construction, and dev / eval free of the data the
committed weights were trained on (the legacy streams, `ledger`). The full check of the committed
filter (2.5 M problems drawn again, ~2 minutes) is `python -m canvasq.testbed.ledger_build check`."""

import re

import pytest

from canvasq.testbed import ledger, ledger_build, tasks

FAMILIES = (*tasks.TASKS, *tasks.VARIANTS)
# Legacy streams evaluation used to draw (seeds 1, 7, 21-23, ...): round 1's training streams.
OLD_EVAL_STREAMS = (1, 7, 21, 22, 23, 31, 32, 33, 41, 42, 43, 51, 52, 53)
# Whole legacy streams, one or more from every round, the repair and the tokenizer's corpus.
FULL_STREAMS = (
    ("arith", 21, 5000),
    ("arith", 1_000_003 + 7, 5000),
    ("arith", 2 * 1_000_003 + 59, 5000),
    ("arith", 3 * 1_000_003 + 30, 5000),
    ("arith", 5 * 1_000_003 + 3, 5000),
    ("arith", 12345, 20_000),
    ("code", 1, 5000),
    ("code", 3 * 1_000_003 + 59, 5000),
    ("code", 5 * 1_000_003, 5000),
)


@pytest.mark.parametrize("split", ["dev", "eval"])
@pytest.mark.parametrize("task", FAMILIES)
def test_held_out_problems_are_in_their_bucket_and_never_legacy_training(task, split):
    for seed in (0, 1, 21, 61):
        problems = tasks.generate(task, 100, seed, split=split)
        assert len(problems) == 100
        assert [p.uid for p in problems] == [f"{task}-{split}-{seed}-{i}" for i in range(100)]
        for p in problems:
            assert tasks.split_of(p.prompt) == split, p.uid
            assert not ledger.in_legacy_training(p.prompt), p.uid
            assert p.task == task


@pytest.mark.parametrize("task", FAMILIES)
def test_train_split_never_draws_a_dev_or_eval_problem(task):
    n = 2000 if task == "arith" else 300
    for seed in (0, 1_000_003 + 5):
        problems = tasks.generate(task, n, seed, split="train")
        assert len(problems) == n
        assert {tasks.split_of(p.prompt) for p in problems} == {"train"}


@pytest.mark.parametrize("task", tasks.TASKS)
def test_splits_of_one_seed_share_no_prompt(task):
    n = 2000 if task == "arith" else 200
    prompts = {s: {p.prompt for p in tasks.generate(task, n, 3, split=s)} for s in tasks.SPLITS}
    assert not prompts["train"] & prompts["dev"]
    assert not prompts["train"] & prompts["eval"]
    assert not prompts["dev"] & prompts["eval"]


def test_partition_covers_every_prompt_in_the_stated_shares():
    """About 1/8 eval, 1/8 dev and 3/4 train of any stream (legacy prompts are a uniform sample)."""
    prompts = [p.prompt for p in tasks.legacy_generate("arith", 8000, 999_999_999)]
    shares = {s: sum(tasks.split_of(x) == s for x in prompts) / len(prompts) for s in tasks.SPLITS}
    assert abs(shares["eval"] - 1 / 8) < 0.015 and abs(shares["dev"] - 1 / 8) < 0.015
    assert abs(shares["train"] - 3 / 4) < 0.02


@pytest.mark.parametrize("entry", FULL_STREAMS, ids=[f"{t}:{s}" for t, s, _ in FULL_STREAMS])
def test_filter_holds_every_prompt_of_legacy_training_streams(entry):
    task, seed, n = entry
    assert entry in ledger.LEGACY_TRAINING
    missing = [p.uid for p in tasks.legacy_generate(task, n, seed) if not ledger.in_legacy_training(p.prompt)]
    assert missing == []


def test_legacy_list_holds_the_committed_rounds():
    """train_data.build_pool's streams (seed × 1,000,003 + i, 5,000 per stream) of rounds 1-4 at 300,000 per
    task, the repair's at 20,000, and the tokenizer's corpus."""
    listed = set(ledger.LEGACY_TRAINING)
    for task in tasks.TASKS:
        for seed in (0, 1, 2, 3):
            assert {(task, seed * 1_000_003 + i, 5000) for i in range(60)} <= listed
        assert {(task, 5 * 1_000_003 + i, 5000) for i in range(4)} <= listed
        assert (task, 12345, 20_000) in listed
    assert ledger.legacy_filter().list_digest == ledger._list_digest(ledger.LEGACY_TRAINING)


def test_filter_false_positives_are_about_one_percent():
    """A filter that held everything would make dev and eval skip every candidate."""
    probes = [f"an arith problem nobody trained on, number {i}" for i in range(20_000)]
    rate = sum(ledger.in_legacy_training(x) for x in probes) / len(probes)
    assert rate < 0.02
    assert 0.005 < ledger.legacy_filter().false_positive_rate() < 0.015


def test_no_eval_prompt_of_seeds_0_to_100_is_a_legacy_training_prompt():
    legacy = {p.prompt for s in OLD_EVAL_STREAMS for p in tasks.legacy_generate("arith", 5000, s)}
    legacy |= {p.prompt for s in OLD_EVAL_STREAMS for p in tasks.legacy_generate("code", 500, s)}
    legacy |= {p.prompt for t, s, n in FULL_STREAMS for p in tasks.legacy_generate(t, min(n, 2000), s)}
    evals = [p.prompt for seed in range(101) for p in tasks.generate("arith", 100, seed)]
    evals += [p.prompt for seed in range(101) for p in tasks.generate("code", 10, seed)]
    assert len(evals) == 101 * 110
    assert not legacy & set(evals)


def test_old_eval_seeds_were_training_data():
    """Why the splits exist: the unpartitioned generator's seed 21 is round 1's training stream 21."""
    for task in tasks.TASKS:
        old = tasks.legacy_generate(task, 200, 21)
        assert all(ledger.in_legacy_training(p.prompt) for p in old)
        assert not {p.prompt for p in old} & {p.prompt for p in tasks.generate(task, 200, 21)}


@pytest.mark.parametrize("split", tasks.SPLITS)
@pytest.mark.parametrize("task", FAMILIES)
def test_generate_is_deterministic_and_returns_n(task, split):
    a = tasks.generate(task, 40, 5, split=split)
    assert a == tasks.generate(task, 40, 5, split=split)
    assert len(a) == 40 and len({p.uid for p in a}) == 40
    assert all(re.fullmatch(rf"{task}-{split}-5-\d+", p.uid) for p in a)
    assert [p.prompt for p in a] != [p.prompt for p in tasks.generate(task, 40, 6, split=split)]
    assert tasks.generate(task, 0, 5, split=split) == []
    assert a[:10] == tasks.generate(task, 10, 5, split=split)  # a prefix of the same stream


def test_eval_is_the_default_and_aliases_resolve():
    assert tasks.generate("math", 5, 2) == tasks.generate("arith", 5, 2, split="eval")


def test_unknown_split_is_rejected():
    with pytest.raises(ValueError, match="unknown split"):
        tasks.generate("arith", 1, 0, split="test")


def test_filter_built_from_a_list_holds_exactly_that_list(tmp_path):
    """build's vectorised probes and the lookup's agree; check finds nothing missing."""
    entries = (("arith", 424242, 3000), ("code", 424242, 200))
    path = tmp_path / "small.bloom"
    bloom = ledger_build.build(path, workers=1, entries=entries)
    assert bloom.k == 7 and bloom.n >= 3100
    report = ledger_build.check(path, workers=1, n_probes=20_000, entries=entries)
    assert report["missing"] == 0 and report["list_matches"]
    assert report["false_positive_rate"] < 0.02
    loaded = ledger.Bloom.from_bytes(path.read_bytes())
    assert all(x in loaded for x in ledger_build.legacy_training_prompts(entries))
    assert not ledger_build.check(path, workers=1, n_probes=10, entries=entries[:1])["list_matches"]
