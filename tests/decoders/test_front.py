"""Pipe's and Funnel's front canvas on the trained testbed: the default (`front="commit"`, D2F's final
commits) decodes today's tokens, and `front="revise"` finishes the front the native sampler's way
(decoders/front.py): nothing final until the canvas is accepted whole, by the rule or at the bound."""

import hashlib
import json

import pytest
import torch
from helpers import TESTBED_DIR, trained_testbed

from canvasq.decoders import DecodeBatch, DecodeRequest, run_batch
from canvasq.decoders.configs import FunnelConfig, PipeConfig
from canvasq.decoders.pipe import PipeDecoder

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not trained_testbed(), reason="needs the trained testbed checkpoint (models/testbed)"),
]

REVISE = {"front": "revise"}


@pytest.fixture(scope="module")
def bundle():
    from canvasq.model.loading import load_bundle

    return load_bundle(str(TESTBED_DIR))


def _batch(bundle, task, n=4, seed=7, max_tokens=96):
    from canvasq.testbed import tasks

    problems = tasks.generate(task, n, seed, split="dev")
    reqs = [DecodeRequest(p.uid, bundle.encode_prompt(p.prompt, task), max_tokens, task) for p in problems]
    return DecodeBatch(reqs, seed=seed)


def _digest(res) -> tuple[str, list[int]]:
    ids = [r.token_ids for r in res]
    return hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16], [r.forwards for r in res]


# pipe and funnel at their defaults before `front` existed (0e75883), dev seed 7, 4 problems, 96 tokens
BEFORE = {
    "pipe/arith": ("0e7e80dcd5a43edb", [10, 12, 9, 7]),
    "funnel/arith": ("0dcbe12b76d3a174", [9, 11, 8, 6]),
    "pipe/code": ("a1615470efa4fb6d", [4, 5, 2, 4]),
    "funnel/code": ("573936710a3e8af6", [4, 4, 2, 3]),
}


@pytest.mark.parametrize("key", sorted(BEFORE))
def test_default_front_decodes_the_tokens_of_before(bundle, key):
    name, task = key.split("/")
    assert _digest(run_batch(bundle, _batch(bundle, task), decoder=name)) == BEFORE[key]


def _record(monkeypatch):
    """Every canvas update of the decode, as the loop makes it: whether the canvas was the front (the
    first with an open position and full: D2F's front is the first canvas, a revising one the first
    with an open position), its input and committed rows before, the forward's p(argmax) and argmax,
    its committed rows after, and its steps as the front."""
    steps = []
    real = PipeDecoder._update_canvas

    def update(self, s, co):
        cv, idx = co.part.cv, co.part.idx
        front = next(c for c in s.canvases if not bool(c.committed.all())) is cv
        before = (cv.tokens[idx].clone(), cv.committed.clone())
        newly = real(self, s, co)
        steps.append(
            {
                "row": s.row,
                "canvas": cv.index,
                "front": front and cv.state == "full",
                "input": before[0],
                "was": before[1],
                "conf": co.conf.clone(),
                "logits": co.logits.clone(),
                "arg": co.arg.clone(),
                "now": cv.committed.clone(),
                "front_steps": cv.front_steps,
                "final": cv.tokens,  # the canvas's own tensor: its tokens once the decode ends
                "idx": idx,
            }
        )
        return newly

    monkeypatch.setattr(PipeDecoder, "_update_canvas", update)
    return steps


@pytest.mark.parametrize("name", ["pipe", "funnel"])
def test_revising_front_is_accepted_whole_by_the_rule(bundle, name, monkeypatch):
    """A canvas commits all of its positions at once, on the first front step on which every one
    clears τ_conf with its argmax equal to the input it rode with (or at `front_wait`), and nothing
    before; canvases behind the front never commit. D2F's rule, on the same prompts, commits a front
    position by position (the check below fails on it)."""
    steps = _record(monkeypatch)
    cfg = (FunnelConfig if name == "funnel" else PipeConfig)(**REVISE)
    res = run_batch(bundle, _batch(bundle, "arith"), decoder=name, overrides=REVISE)
    assert all(r.error is None for r in res)
    accepted = 0
    for st in steps:
        newly = st["now"] & ~st["was"]
        if not st["front"]:
            assert not bool(newly.any())
            continue
        assert not bool(st["was"].any())  # a front has nothing final before its acceptance
        ok = bool(((st["conf"] >= cfg.tau_conf) & (st["arg"] == st["input"])).all())
        if bool(newly.any()):
            assert bool(newly.all()), "a revising front commits whole"
            assert ok or st["front_steps"] == cfg.front_wait
            accepted += 1
        else:
            assert not ok and st["front_steps"] < cfg.front_wait
    assert (
        accepted == sum(r.stats.get("front_accepts", 0) + r.stats.get("front_timeouts", 0) for r in res) > 0
    )
    assert sum(r.stats.get("forced_accepts", 0) for r in res) == 0
    steps.clear()
    run_batch(bundle, _batch(bundle, "arith"), decoder=name)
    partial = [st for st in steps if st["front"] and bool((st["now"] & ~st["was"]).any())]
    assert any(not bool(st["now"].all()) for st in partial)  # D2F's: part of a canvas final


def test_revising_front_changes_tokens_that_would_have_been_final(bundle, monkeypatch):
    """An open front position whose argmax cleared τ_conf (committed for good under D2F's rule) ends
    with another token: the revision D2F's rule cannot make (none on the same prompts under it)."""
    steps = _record(monkeypatch)

    def revised(overrides) -> int:
        steps.clear()
        run_batch(bundle, _batch(bundle, "arith", n=8), decoder="pipe", overrides=overrides)
        n = 0
        for st in (st for st in steps if st["front"]):
            sure = (st["conf"] >= PipeConfig().tau_conf) & ~st["was"][st["idx"]]  # open, clears τ
            n += int((sure & (st["arg"] != st["final"][st["idx"]])).sum())
        return n

    assert revised(REVISE) > 0
    assert revised({}) == 0


@pytest.mark.parametrize("name", ["pipe", "funnel"])
def test_unconfident_front_waits_to_the_bound(bundle, name):
    """τ_conf = 1 (cleared only where fp32 rounds p(argmax) to 1): D2F's rule force-commits one
    position a step; the revising front waits instead, and a canvas that the rule does not accept is
    accepted whole after `front_wait` steps, so a canvas takes at most that many decoder steps."""
    batch = _batch(bundle, "arith", n=2, max_tokens=64)
    res = run_batch(bundle, batch, decoder=name, overrides={**REVISE, "tau_conf": 1.0, "front_wait": 3})
    C = bundle.canvas_length
    for r in res:
        assert r.error is None and r.stats.get("forced_accepts", 0) == 0
        canvases = -(-len(r.token_ids) // C)
        assert r.stats.get("front_accepts", 0) + r.stats.get("front_timeouts", 0) == canvases
        assert r.stats.get("commits", 0) == canvases * C
        # the funnel's accepted canvas rides its promotion step beside the next canvas's first step
        assert sum(t.kind == "decode" for t in r.traces) <= canvases * 3
    assert sum(r.stats.get("front_timeouts", 0) for r in res) >= 1
    old = run_batch(
        bundle, _batch(bundle, "arith", n=1, max_tokens=32), decoder=name, overrides={"tau_conf": 1.0}
    )
    assert old[0].stats.get("forced_accepts", 0) > 0


@pytest.mark.parametrize("name", ["pipe", "funnel"])
def test_native_front_stops_by_the_native_rule(bundle, name, monkeypatch):
    """`front="native"`: the front canvas runs official's sampler. It commits whole, on a step whose
    argmax equals the previous front step's (HF's stability test, S = 1 on the testbed) or at the
    N-step cap; until then its next input is the sampler's draw and noise, not its argmax (a revising
    front rides as its argmax); the same seed decodes the same tokens."""
    from canvasq.decoders.configs import OfficialConfig
    from canvasq.decoders.sampling import SamplerSettings

    smp = SamplerSettings.resolve(bundle.hf_model, OfficialConfig())
    N = smp.steps
    steps = _record(monkeypatch)
    native = {"front": "native"}
    res = run_batch(bundle, _batch(bundle, "arith"), decoder=name, overrides=native)
    assert all(r.error is None for r in res)
    last: dict = {}  # (row, canvas) -> its previous front step
    accepted, renoised = 0, 0
    for st in steps:
        if not st["front"]:
            assert not bool((st["now"] & ~st["was"]).any())
            continue
        key, prev = (st["row"], st["canvas"]), last.get((st["row"], st["canvas"]))
        newly = st["now"] & ~st["was"]
        if bool(newly.any()):
            assert bool(newly.all())
            cap = st["front_steps"] >= N
            temp = smp.t_min + (smp.t_max - smp.t_min) * (N - st["front_steps"] + 1) / N
            entropy = torch.distributions.Categorical(logits=st["logits"] / temp).entropy().mean()
            sure = bool(entropy < smp.confidence_threshold)
            assert cap or (sure and prev is not None and bool((prev["arg"] == st["arg"]).all()))
            accepted += 1
        elif prev is not None:
            renoised += int(bool((st["input"] != prev["arg"]).any()))
        last[key] = st
    assert (
        accepted == sum(r.stats.get("front_accepts", 0) + r.stats.get("front_timeouts", 0) for r in res) > 0
    )
    assert renoised > 0
    again = run_batch(bundle, _batch(bundle, "arith"), decoder=name, overrides=native)
    assert [r.token_ids for r in again] == [r.token_ids for r in res]


def test_front_options_are_checked():
    with pytest.raises(ValueError, match="front"):
        PipeConfig(front="final")
    with pytest.raises(ValueError, match="draft_only"):
        PipeConfig(front="revise", draft_only=False)
    with pytest.raises(ValueError, match="front_wait"):
        FunnelConfig(front="revise", front_wait=0)
