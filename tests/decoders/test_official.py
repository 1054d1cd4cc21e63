"""`official`: the native sampler on canvasq's runtime. Against HF generate() on the trained testbed
(same tokens where the draws can be aligned), batch invariance, step cap, max_tokens, cancellation."""

import json

import pytest
import torch
from helpers import tiny_bundle

from canvasq.decoders import CANCELLED, DecodeBatch, DecodeRequest, run_batch
from canvasq.decoders.official import OfficialDecoder
from canvasq.decoders.registry import make_config
from canvasq.decoders.sampling import SamplerSettings
from canvasq.decoders.slots import drain
from canvasq.model.loading import load_bundle
from canvasq.testbed import tasks

ALIGNED = {"seed_mode": "plain", "sc_topk": None, "cuda_graphs": "off"}


@pytest.fixture(scope="module")
def testbed():
    return load_bundle()


@pytest.fixture(scope="module")
def testbed64():
    """fp64, for equal tokens from two paths that sum in different orders: in fp32 those flip a near-tie
    draw now and then (folded encoder rows: one row of 12 on 4 of 14 eval seeds, none in fp64)."""
    return load_bundle(dtype=torch.float64)


def _problems(n_arith=4, n_code=3, seed=11):
    return tasks.generate("arith", n_arith, seed) + tasks.generate("code", n_code, seed)


def _drain(dec, reqs, slots: int = 4, seed: int = 3):
    """Every request through `dec.stream` (continuous batching over `slots`); results in request order."""
    return drain(dec, reqs, slots, seed)


@pytest.mark.parametrize(
    "knobs",
    [{}, {"t_min": 0.001, "t_max": 0.002}, {"max_denoising_steps": 3}],
    ids=["checkpoint-config", "greedy", "capped"],
)
def test_same_tokens_as_hf_generate_at_batch_one(testbed, knobs):
    """Batch 1, fp32, the request's generator seeded as `torch.manual_seed(seed)` and full-vocabulary
    self-conditioning: the runtime decoder draws what generate() draws, so every token matches (and
    so does the number of model passes)."""
    hf_knobs = {k: v for k, v in knobs.items() if k == "max_denoising_steps"}
    for i, p in enumerate(_problems()):
        ids = testbed.encode_prompt(p.prompt, p.task)
        batch = DecodeBatch([DecodeRequest(f"r{i}", ids, 96, p.task)], seed=100 + i)
        if "t_min" in knobs:  # generate() takes the temperature ramp as generation kwargs
            ref = _hf_generate(testbed, ids, 96, 100 + i, **knobs)
        else:
            ref = run_batch(testbed, batch, "hf", overrides=hf_knobs)[0].token_ids
        got = run_batch(testbed, batch, "official", overrides={**ALIGNED, **knobs})[0]
        assert got.error is None
        assert got.token_ids == ref, f"problem {i}: {testbed.decode_text(got.token_ids)!r}"


def _hf_generate(bundle, ids, max_tokens, seed, **kw):
    C = bundle.canvas_length
    torch.manual_seed(seed)
    x = torch.tensor([ids])
    out = bundle.hf_model.generate(x, max_new_tokens=-(-max_tokens // C) * C, **kw).sequences[0, len(ids) :]
    row = out.tolist()
    stop = next((j for j, t in enumerate(row) if t in (bundle.eos_id, bundle.pad_id)), len(row))
    return row[: min(stop, max_tokens)]


def test_sampler_settings_resolve_like_generate(testbed):
    s = SamplerSettings.resolve(testbed.hf_model, make_config("official"))
    assert (s.steps, s.entropy_bound, s.t_min, s.t_max) == (48, 0.1, 0.4, 0.8)
    assert (s.stability_threshold, s.confidence_threshold) == (1, 0.005)
    capped = SamplerSettings.resolve(testbed.hf_model, make_config("official", {"max_denoising_steps": 2}))
    assert capped.steps == 2


@pytest.mark.parametrize("sampler", ["torch", "fused"])
def test_batched_equals_unbatched_per_row(testbed, sampler):
    """Row seeds (the default): a request's tokens do not depend on which requests share its batch,
    whose canvases end at different steps (rows leave the forward as they stop). The fused draws
    (one launch for the batch, keyed per request) keep that."""
    reqs = [
        DecodeRequest(f"q{i}", testbed.encode_prompt(p.prompt, p.task), 64, p.task)
        for i, p in enumerate(_problems(3, 2, seed=5))
    ]
    knobs = {"sampler": sampler}
    together = run_batch(testbed, DecodeBatch(reqs, seed=3), "official", overrides=knobs)
    for req, res in zip(reqs, together):
        alone = run_batch(testbed, DecodeBatch([req], seed=3), "official", overrides=knobs)[0]
        assert res.error is None and res.token_ids == alone.token_ids


def test_fused_draws_answer_like_the_torch_draws(testbed):
    """Same distribution, other random numbers: on 40 arith problems the fused sampler's accuracy and
    forwards stay near the per-request torch draws' (the GPU guard in BENCHMARKS.md is the claim), and
    the two samplers do draw differently."""
    probs = tasks.generate("arith", 40, 7)
    reqs = [
        DecodeRequest(f"a{i}", testbed.encode_prompt(p.prompt, p.task), 128, p.task)
        for i, p in enumerate(probs)
    ]
    arms = {}
    for sampler in ("torch", "fused"):
        res = run_batch(testbed, DecodeBatch(reqs, seed=7), "official", overrides={"sampler": sampler})
        arms[sampler] = (
            sum(bool(tasks.verify(p, r.text)) for p, r in zip(probs, res)) / len(probs),
            sum(r.forwards for r in res) / len(res),
            [r.token_ids for r in res],
        )
    (acc_t, fwd_t, tok_t), (acc_f, fwd_f, tok_f) = arms["torch"], arms["fused"]
    assert abs(acc_t - acc_f) <= 0.15 and acc_f >= 0.6, arms
    assert abs(fwd_t - fwd_f) <= 0.2 * fwd_t
    assert tok_t != tok_f


def test_step_cap_max_tokens_and_traces():
    b = tiny_bundle()
    C = b.canvas_length
    reqs = [
        DecodeRequest("a", [2, 5, 6, 7, 8, 9, 4], 13),
        DecodeRequest("b", [2, 9, 4], 8),
        DecodeRequest("c", [2, 11, 12, 13, 4], 16),
    ]
    res = run_batch(b, DecodeBatch(reqs, seed=0), "official", overrides={"max_denoising_steps": 3})
    for req, r in zip(reqs, res):
        assert r.error is None and r.decoder == "official"
        assert len(r.token_ids) <= req.max_tokens
        if r.finish_reason == "length":
            assert len(r.token_ids) == req.max_tokens
        assert r.forwards == len(r.traces)
        kinds = [t.kind for t in r.traces]
        canvases = kinds.count("encode")  # the prefill, then one commit pass per later canvas
        assert kinds[0] == "encode" and 1 <= canvases <= -(-req.max_tokens // C)
        decodes = [t for t in r.traces if t.kind == "decode"]
        assert len(decodes) <= canvases * 3  # never more than the cap per canvas
        assert all(t.own_rows == C and 0 <= t.own_commits <= C for t in decodes)


def test_bad_request_fails_alone_and_cancel():
    b = tiny_bundle()
    reqs = [DecodeRequest("a", [2, 5, 6], 16), DecodeRequest("empty", [], 8)]
    res = run_batch(b, DecodeBatch(reqs), "official", overrides={"max_denoising_steps": 2})
    assert res[0].error is None and res[1].error == "empty prompt"
    calls = {"n": 0}

    def stop():
        calls["n"] += 1
        return calls["n"] > 2

    res = run_batch(b, DecodeBatch(reqs[:1]), "official", should_stop=stop)
    assert res[0].error == CANCELLED and res[0].finish_reason == CANCELLED


def test_global_rng_untouched_and_seeded_runs_repeat():
    b = tiny_bundle()
    batch = DecodeBatch([DecodeRequest("a", [2, 5, 6, 7], 16), DecodeRequest("b", [2, 9], 16)], seed=4)
    torch.manual_seed(1)
    expect = torch.rand(2)
    torch.manual_seed(1)
    r1 = run_batch(b, batch, "official")
    assert torch.equal(torch.rand(2), expect)
    r2 = run_batch(b, batch, "official")
    assert [r.token_ids for r in r1] == [r.token_ids for r in r2]


def test_graph_runner_path_and_top_k_sc_decode(testbed):
    """The prepared (graph) forwards and top-k self-conditioning are the production path: they run
    and give answers on the trained model (they differ from the eager full-SC path by rounding)."""
    p = tasks.generate("code", 1, 2)[0]
    req = DecodeRequest("g", testbed.encode_prompt(p.prompt, p.task), 64, p.task)
    res = run_batch(testbed, DecodeBatch([req], seed=0), "official", overrides={"cuda_graphs": "on"})[0]
    assert res.error is None and res.token_ids
    dec = OfficialDecoder(testbed, make_config("official", {"cuda_graphs": "on"}))
    assert dec.graphs is not None


def test_graphed_encoder_passes_pad_only_on_free_slots(testbed, monkeypatch):
    """A graphed encoder pass carries only the rows that prefill or commit; it is padded to a
    window-count bucket on free slots, whose entries it then empties. A slot held by a live row that
    sat out the pass is never padding: such rows lost their prompt and canvases mid-answer, which
    cost the GPU's default path 9 points against HF generate() (BENCHMARKS.md, "GPU accuracy")."""
    from canvasq.model.arena import KVArena

    dec = OfficialDecoder(testbed, make_config("official", {"cuda_graphs": "on"}))
    padded, hits = [], []
    plain_spare, plain_reset = OfficialDecoder._spare_slots, KVArena.reset

    def spare(self, used, count, rows):
        got = plain_spare(self, used, count, rows)
        padded.extend(got)
        return got

    def reset(arena, slot):
        pool = getattr(dec, "pool", None)
        if pool is not None and any(s.slot == slot and not s.done for s in pool.live):
            hits.append(slot)
        plain_reset(arena, slot)

    monkeypatch.setattr(OfficialDecoder, "_spare_slots", spare)
    monkeypatch.setattr(KVArena, "reset", reset)
    probs = tasks.generate("arith", 6, 5)
    reqs = [DecodeRequest(p.uid, testbed.encode_prompt(p.prompt, p.task), 96, p.task) for p in probs]
    res = _drain(dec, reqs, slots=6)
    assert all(r.error is None and r.token_ids for r in res)
    assert padded, "no forward was padded: the case is not exercised"
    assert not hits, f"live rows' slots emptied as padding: {hits}"


def test_graphed_forwards_pad_windows_to_a_bucket_on_free_slots(testbed):
    """Under continuous batching the live count changes; graphed forwards are padded to a window-count
    bucket on free slots (zero SC, logits dropped): the real windows' logits are unchanged, the
    padding slots stay empty, and counts 5..8 share one graph."""
    import canvasq.decoders.base as base_mod

    dec = OfficialDecoder(testbed, make_config("official", {"cuda_graphs": "on"}))
    dec.arena = dec.new_arena(8, 256)
    p = tasks.generate("arith", 5, 4)
    for slot, prob in enumerate(p):
        ids = torch.tensor(testbed.encode_prompt(prob.prompt, prob.task))
        dec.encode([(slot, ids, torch.arange(ids.numel()))])
    lengths = list(dec.arena.length)
    assert lengths[5:] == [0, 0, 0]  # the encode's own padding was emptied again
    g = torch.Generator().manual_seed(0)
    from canvasq.decoders.state import Canvas
    from canvasq.decoders.windows import canvas_window, window_sc

    wins = []
    for slot in range(5):
        cv = Canvas(
            0,
            lengths[slot],
            torch.randint(0, dec.V, (dec.C,), generator=g),
            torch.zeros(dec.C, dtype=torch.bool),
            "full",
        )
        wins.append(canvas_window(slot, cv.tokens, cv.start, *window_sc(cv, dec._zero_sc)))
    padded = dec.forward(wins)
    assert padded.logits.shape[0] == 5 * dec.C and len(padded.offsets) == 6
    eager = dec.rt.decode(dec.arena, wins)
    torch.testing.assert_close(padded.logits, eager.logits, rtol=1e-4, atol=1e-4)
    assert list(dec.arena.length[5:]) == [0, 0, 0]
    keys = [k for k in dec.graphs.graphs if not k[0]]
    assert len(keys) == 1 and keys[0][1] == 8 == next(b for b in base_mod.WINDOW_BUCKETS if b >= 5)


def test_steps_run_in_slot_order_with_the_same_tokens(testbed):
    """Under continuous batching (3 slots, 9 requests) each decoder step's windows go in arena-slot
    order (a full step then reads the arena as one slice), and every row's tokens are what admission
    order gives (rows draw from their own generators)."""
    from canvasq.decoders.registry import make_decoder

    reqs = [
        DecodeRequest(f"s{i}", testbed.encode_prompt(p.prompt, p.task), 96, p.task)
        for i, p in enumerate(_problems(6, 3, seed=7))
    ]
    arms = {}
    for ordered in (False, True):
        dec = make_decoder("official", testbed, {"slot_order": ordered})
        orders = []
        forward = dec.forward

        def spy(windows, forward=forward, orders=orders, **kw):
            orders.append([w.slot for w in windows])
            return forward(windows, **kw)

        dec.forward = spy
        arms[ordered] = ([r.token_ids for r in _drain(dec, reqs, slots=3, seed=4)], orders)
    assert arms[True][0] == arms[False][0]
    assert all(o == sorted(o) for o in arms[True][1])
    assert any(o != sorted(o) for o in arms[False][1])  # admission order does leave slots unsorted


def test_folded_encoder_passes_give_the_same_tokens_in_fewer_forwards(testbed64):
    """`fold_encode`: retired canvases and prompts ride in the next decoder forward as causal rows in
    front of their canvas (a prompt longer than a canvas as several query blocks). Under continuous
    batching (4 slots, 12 requests, a few prompts cut to one canvas, the rest longer) no encoder pass
    runs at all, there are fewer forwards, and every row's tokens are the separate passes' tokens
    (in fp64: `testbed64`)."""
    from canvasq.decoders.registry import make_decoder

    testbed = testbed64

    reqs = [
        DecodeRequest(f"f{i}", testbed.encode_prompt(p.prompt, p.task), 128, p.task)
        for i, p in enumerate(_problems(6, 6, seed=11))
    ]
    C = testbed.canvas_length
    for r in reqs[::3]:
        r.prompt_ids = r.prompt_ids[-C:]  # short prompts ride too
    long = sum(len(r.prompt_ids) > C for r in reqs)
    arms = {}
    for fold in (False, True):
        dec = make_decoder("official", testbed, {"fold_encode": fold})
        assert dec.folds == fold
        res = _drain(dec, reqs)
        assert all(r.error is None for r in res)
        encodes = [t for r in res for t in r.traces if t.kind == "encode"]
        arms[fold] = (
            [r.token_ids for r in res],
            len({t.index for r in res for t in r.traces}),
            sum(t.own_rows for t in encodes),
            {t.states for t in encodes},
        )
    assert arms[True][0] == arms[False][0]
    assert arms[True][1] < arms[False][1]
    assert arms[True][3] == set() and arms[False][3] == {"prefill", "commit"}
    assert arms[True][2] == 0 and 0 < long < len(reqs)


def test_deferred_commits_share_the_prefill_pass(testbed):
    """Under continuous batching (4 slots, 16 requests) a finished canvas's encoder pass waits for the
    next prefill pass: fewer model passes, the same tokens (the row's next step still sees its cache)."""
    from canvasq.decoders.registry import make_decoder

    reqs = [
        DecodeRequest(f"q{i}", testbed.encode_prompt(p.prompt, p.task), 128, p.task)
        for i, p in enumerate(_problems(12, 4, seed=5))
    ]
    arms = {}
    for defer in (False, True):
        dec = make_decoder("official", testbed, {"defer_commits": defer})
        res = _drain(dec, reqs)
        passes = {t.index for r in res for t in r.traces}
        encodes = {t.index for r in res for t in r.traces if t.kind == "encode"}
        kinds = {t.states for r in res for t in r.traces if t.kind == "encode"}
        arms[defer] = ([r.token_ids for r in res], len(passes), len(encodes), kinds)
    assert arms[True][0] == arms[False][0]
    assert arms[True][2] < arms[False][2] and arms[True][1] < arms[False][1]
    assert arms[True][3] == {"prefill", "commit"}


def test_deferred_lm_head_reads_logits_by_row_group_with_the_same_tokens(testbed):
    """A forward whose fp32 logits would pass `Runtime.defer_head_bytes` keeps its final hidden state;
    official then computes logits for two windows at a time (`DecodeOutput.rows_logits`), never the
    whole step's [rows, V], and every row's tokens are the eager head's (3 slots, 9 requests). Rows
    with a `response_format` are masked group by group too: still no whole-step logits."""
    from canvasq.decoders.registry import make_decoder

    answer = {
        "type": "object",
        "properties": {"answer": {"type": "integer"}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    reqs = [
        DecodeRequest(
            f"h{i}", testbed.encode_prompt(p.prompt, p.task), 96, p.task, answer if i % 3 == 1 else None
        )
        for i, p in enumerate(_problems(6, 3, seed=5))
    ]
    arms = {}
    for defer in (False, True):
        dec = make_decoder("official", testbed, {})
        C, V, saved = dec.C, dec.rt.vocab_size, dec.rt.defer_head_bytes
        dec.rt.defer_head_bytes = 2 * 4 * C * V if defer else 0  # more than two windows defer
        seen, heads = [], []
        forward, head = dec.forward, dec.rt.head_logits

        def spy(windows, forward=forward, seen=seen, **kw):
            out = forward(windows, **kw)
            seen.append((len(windows), out.deferred))
            if out.deferred:  # read after the forward's no_grad, still no autograd graph
                assert not out.rows_logits(0, 1).requires_grad
            return out

        def head_spy(h, fp8, out=None, head=head, heads=heads):
            heads.append(h.shape[0])
            return head(h, fp8, out=out)

        dec.forward, dec.rt.head_logits = spy, head_spy
        try:
            arms[defer] = [r.token_ids for r in _drain(dec, reqs, slots=3, seed=4)]
        finally:
            dec.rt.defer_head_bytes = saved
            del dec.rt.head_logits
        assert all(d == (defer and n > 2) for n, d in seen)
        if defer:
            assert any(n == 3 for n, _ in seen) and max(heads) <= 2 * C
        else:
            assert max(heads) == 3 * C
    assert arms[True] == arms[False]
    assert all(json.loads(testbed.decode_text(ids))["answer"] is not None for ids in arms[True][1::3])


def test_cap_on_read_gives_the_capped_heads_tokens(testbed, monkeypatch):
    """With the fused sampler, top-k self-conditioning and a deferred head, the sampler reads the head's
    output before the soft cap and caps as it reads (`cap_on_read`, `DecodeOutput.rows_uncapped`): the
    tokens equal those of the capped fp32 logits (on the CPU both caps are torch's ops), and only that
    arm reads uncapped rows."""
    from canvasq.decoders.registry import make_decoder
    from canvasq.model.windows import DecodeOutput

    reads = []
    rows_uncapped = DecodeOutput.rows_uncapped

    def spy(self, start, stop):
        raw = rows_uncapped(self, start, stop)
        reads.append(raw is not None)
        return raw

    monkeypatch.setattr(DecodeOutput, "rows_uncapped", spy)
    reqs = [
        DecodeRequest(f"u{i}", testbed.encode_prompt(p.prompt, p.task), 96, p.task)
        for i, p in enumerate(_problems(4, 2, seed=9))
    ]
    arms = {}
    for on_read in (False, True):
        dec = make_decoder("official", testbed, {"sampler": "fused", "cap_on_read": on_read})
        assert dec._one_group  # top-k SC on the testbed's vocabulary
        saved, dec.rt.defer_head_bytes = dec.rt.defer_head_bytes, 1  # every decoder forward defers
        reads.clear()
        try:
            tokens = [r.token_ids for r in _drain(dec, reqs, slots=3, seed=6)]
            arms[on_read] = (tokens, sum(reads), dec.slots.sc[1].clone())  # the last steps' top-k SC
        finally:
            dec.rt.defer_head_bytes = saved
    (capped, n_capped, sc_capped), (read, n_read, sc_read) = arms[False], arms[True]
    assert read == capped and all(read)
    assert n_read > 0 and n_capped == 0
    assert torch.equal(sc_read, sc_capped) and bool(sc_read.abs().max() > 0)  # capped values, as fed on


def test_draw_rule_reaches_the_fused_sampler(testbed, monkeypatch):
    """`draw` (OfficialConfig) is the rule the fused sampler's kernel is asked for, every step; an
    unknown rule is refused by the config (the kernels' own test checks the inverse-CDF draws)."""
    from canvasq import kernels
    from canvasq.decoders.registry import make_decoder

    asked = []
    real = kernels.softmax_sample

    def spy(*args, **kw):
        asked.append(kw.get("draw"))
        return real(*args, **kw)

    monkeypatch.setattr(kernels, "softmax_sample", spy)
    reqs = [DecodeRequest("d0", testbed.encode_prompt(p.prompt, p.task), 64, p.task) for p in _problems(1, 0)]
    for rule in ("gumbel", "invcdf"):
        asked.clear()
        _drain(make_decoder("official", testbed, {"sampler": "fused", "draw": rule}), reqs, slots=1)
        assert asked and set(asked) == {rule}
    with pytest.raises(ValueError, match="draw"):
        make_config("official", {"draw": "argmax"})


def test_a_decoder_that_streamed_is_freed_without_the_cyclic_collector(testbed):
    """A stream leaves no reference cycle through its decoder: dropped, the decoder (and its arena,
    rows and traces) goes at once, not at Python's next full collection, which would free it in the
    middle of a later stream's decode (60-100 ms of a 1.0-1.7 s 600-row stream on an H100 host)."""
    import gc
    import weakref

    dec = OfficialDecoder(testbed, make_config("official", ALIGNED))
    probs = tasks.generate("arith", 3, 5)
    reqs = [DecodeRequest(p.uid, testbed.encode_prompt(p.prompt, p.task), 64, p.task) for p in probs]
    was = gc.isenabled()
    gc.disable()
    try:
        assert all(r.error is None for r in _drain(dec, reqs, slots=2))
        gone, seqs = weakref.ref(dec), [weakref.ref(s) for s in dec.last_seqs]
        del dec
        assert gone() is None, "the decoder waits for the cyclic collector"
        assert all(s() is None for s in seqs), "the stream's rows outlive their decoder"
    finally:
        if was:
            gc.enable()
