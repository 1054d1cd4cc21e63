"""`hf`: HF generate() unchanged, observed for traces, seeded, max_tokens respected."""

import pytest
import torch
from celery.exceptions import SoftTimeLimitExceeded
from helpers import stop_that_raises, tiny_bundle

from canvasq.decoders import CANCELLED, DecodeBatch, DecodeRequest, Interrupted, run_batch

STEPS = {"max_denoising_steps": 3}


def run_hf(*args, **kw):
    """The reference arm: HF generate() unchanged."""
    return run_batch(*args, decoder="hf", **kw)


def _batch(seed=0):
    return DecodeBatch(
        [
            DecodeRequest("a", [2, 5, 6, 7, 8, 9, 4], 13),
            DecodeRequest("b", [2, 9, 4], 8),
            DecodeRequest("c", [2, 11, 12, 13, 4], 16),
        ],
        seed=seed,
    )


def test_seeded_runs_repeat_and_seed_matters():
    b = tiny_bundle()
    r1 = run_hf(b, _batch(0), overrides=STEPS)
    r2 = run_hf(b, _batch(0), overrides=STEPS)
    r3 = run_hf(b, _batch(1), overrides=STEPS)
    assert [r.token_ids for r in r1] == [r.token_ids for r in r2]
    assert [r.token_ids for r in r1] != [r.token_ids for r in r3]


def test_global_rng_untouched():
    b = tiny_bundle()
    torch.manual_seed(123)
    expect = torch.rand(3)
    torch.manual_seed(123)
    run_hf(b, _batch(0), overrides=STEPS)
    assert torch.equal(torch.rand(3), expect)


def test_max_tokens_finish_reason_and_traces():
    b = tiny_bundle()
    res = run_hf(b, _batch(0), overrides=STEPS)
    C = b.canvas_length
    for req, r in zip(_batch(0).requests, res):
        assert r.error is None and r.decoder == "hf"
        assert len(r.token_ids) <= req.max_tokens
        assert r.finish_reason in ("stop", "length")
        if r.finish_reason == "length":
            assert len(r.token_ids) == req.max_tokens
        assert r.forwards == len(r.traces)
        kinds = [t.kind for t in r.traces]
        n_canvases = -(-req.max_tokens // C)
        # prefill + one commit pass per later canvas: every model pass is counted
        assert 1 <= kinds.count("encode") <= n_canvases
        assert kinds[0] == "encode" and r.traces[0].own_rows == len(req.prompt_ids)
        dec = [t for t in r.traces if t.kind == "decode"]
        assert 1 <= len(dec) <= n_canvases * STEPS["max_denoising_steps"]
        assert all(t.own_rows == C and t.ms > 0 for t in dec)
        assert all(t.own_commits >= 0 for t in dec)


def test_bad_request_fails_alone():
    b = tiny_bundle()
    batch = _batch(0)
    batch.requests.append(DecodeRequest("empty", [], 8))
    res = run_hf(b, batch, overrides=STEPS)
    assert res[-1].error == "empty prompt" and res[-1].token_ids == []
    assert all(r.error is None for r in res[:-1])


def test_cancellation_polled_between_forwards():
    b = tiny_bundle()
    calls = {"n": 0}

    def stop():
        calls["n"] += 1
        return calls["n"] > 2

    res = run_hf(b, _batch(0), overrides=STEPS, should_stop=stop)
    assert all(r.error == CANCELLED and r.finish_reason == CANCELLED for r in res)
    # the model is left unpatched
    assert "forward" not in b.hf_model.__dict__
    assert "forward" not in b.hf_model.model.encoder.__dict__


def test_time_limit_inside_generate_hands_back_finished_groups():
    """The worker's soft time limit fires inside HF generate (here: at the last poll of a run): with
    it in `interrupts` the batch ends in `Interrupted` holding the groups that finished; without, it
    is an ordinary failure of the group it hit."""
    b = tiny_bundle()
    should_stop, calls = stop_that_raises(SoftTimeLimitExceeded)

    full = run_hf(b, _batch(0), overrides=STEPS, should_stop=should_stop)
    calls.update(limit_at=calls["n"], n=0)
    with pytest.raises(Interrupted) as info:
        run_hf(b, _batch(0), overrides=STEPS, should_stop=should_stop, interrupts=(SoftTimeLimitExceeded,))
    assert isinstance(info.value.cause, SoftTimeLimitExceeded)
    # "b" needs one canvas: its group ran first; the last poll falls in the group of "a" and "c"
    assert [(r.custom_id, r.token_ids) for r in info.value.done] == [("b", full[1].token_ids)]
    calls["n"] = 0
    res = run_hf(b, _batch(0), overrides=STEPS, should_stop=should_stop)
    errors = [r.error for r in res]
    assert errors[1] is None and errors[0] == errors[2] and errors[0].startswith("SoftTimeLimitExceeded")


def test_w4_arm_is_a_flag_and_leaves_bf16_untouched():
    b = tiny_bundle()
    before = b.hf_model.model.decoder.layers[0].experts.gate_up_proj.clone()
    w4 = run_hf(b, _batch(0), overrides={**STEPS, "experts": "w4"})
    run_hf(b, _batch(0), overrides=STEPS)  # the plain arm still runs after the twin exists
    assert all(r.error is None for r in w4)
    assert all(len(r.token_ids) <= q.max_tokens for r, q in zip(w4, _batch(0).requests))
    from canvasq.decoders.experts import model_with_experts

    twin = model_with_experts(b.hf_model, "w4")
    assert "w4_experts" in twin.model.decoder.layers[0].experts.__dict__
    assert (
        twin.model.decoder.layers[0].self_attn.q_proj.weight
        is b.hf_model.model.decoder.layers[0].self_attn.q_proj.weight
    )
    assert torch.equal(b.hf_model.model.decoder.layers[0].experts.gate_up_proj, before)
    assert "w4_experts" not in b.hf_model.model.decoder.layers[0].experts.__dict__


def test_time_limit_inside_one_group_ends_the_batch():
    """Celery's soft time limit derives from Exception: listed in `interrupts` it is recognised by its
    type and ends the batch at the first group it hits, not swallowed group by group."""
    b = tiny_bundle()

    class TimeLimit(Exception):
        pass

    calls = {"n": 0}
    real = b.hf_model.generate

    def boom(*a, **k):
        calls["n"] += 1
        raise TimeLimit("soft limit")

    b.hf_model.generate = boom
    try:  # three requests, two canvas groups
        with pytest.raises(Interrupted) as info:
            run_hf(b, _batch(0), overrides=STEPS, interrupts=(TimeLimit,))
        assert calls["n"] == 1 and info.value.done == [] and isinstance(info.value.cause, TimeLimit)
        plain = run_hf(b, _batch(0), overrides=STEPS)  # not an interrupt: each group fails alone
        assert calls["n"] == 1 + 2
    finally:
        b.hf_model.generate = real
    assert all(r.error == "TimeLimit: soft limit" for r in plain)


def test_pass_indices_are_distinct_across_canvas_groups():
    b = tiny_bundle()
    res = run_hf(b, _batch(0), overrides=STEPS)  # max_tokens 13, 8, 16 → 2, 1, 2 canvases: two groups
    short = {t.index for t in res[1].traces}
    long_ = {t.index for r in (res[0], res[2]) for t in r.traces}
    assert short and long_ and not (short & long_)


def test_observation_does_not_change_generate():
    """The traced arm returns exactly what a plain `torch.manual_seed(seed); model.generate(...)`
    returns for the same left-padded batch."""
    b = tiny_bundle()
    reqs = _batch(0).requests[:2]  # 13 and 8 tokens → 2 and 1 canvases: use one group
    reqs = [DecodeRequest(r.custom_id, r.prompt_ids, 16) for r in reqs]
    res = run_hf(b, DecodeBatch(reqs, seed=7), overrides=STEPS)
    L = max(len(r.prompt_ids) for r in reqs)
    ids = torch.zeros(2, L, dtype=torch.long)
    mask = torch.zeros(2, L, dtype=torch.long)
    for i, r in enumerate(reqs):
        ids[i, L - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids)
        mask[i, L - len(r.prompt_ids) :] = 1
    torch.manual_seed(7)
    out = b.hf_model.generate(ids, attention_mask=mask, max_new_tokens=16, **STEPS).sequences[:, L:]
    for r, row in zip(res, out.tolist()):
        stop = next((i for i, t in enumerate(row) if t in (b.eos_id, b.pad_id)), len(row))
        assert r.token_ids == row[:stop]
