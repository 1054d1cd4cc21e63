"""Pipe and funnel invariants on a tiny random model (confidence spread over (0, 1) by `peak`)."""

import pytest
import torch
from celery.exceptions import SoftTimeLimitExceeded
from helpers import stop_that_raises, tiny_bundle

from canvasq.decoders import CANCELLED, DecodeBatch, DecodeRequest, Interrupted, run_batch
from canvasq.decoders.registry import UnknownDecoder, make_decoder


@pytest.fixture(scope="module")
def bundle():
    return tiny_bundle(peak=3.0)


def _batch(seed=0, n=3, max_tokens=20):
    prompts = [[2, 5, 6, 7, 8, 9, 4], [2, 9, 4], [2, 11, 12, 13, 14, 15, 16, 17, 18, 4]]
    return DecodeBatch(
        [DecodeRequest(f"r{i}", prompts[i % 3], max_tokens + 3 * i) for i in range(n)], seed=seed
    )


def _ids(res):
    return [r.token_ids for r in res]


@pytest.mark.parametrize("name", ["pipe", "funnel"])
def test_seeded_runs_repeat(bundle, name):
    r1 = run_batch(bundle, _batch(0), decoder=name)
    r2 = run_batch(bundle, _batch(0), decoder=name)
    r3 = run_batch(bundle, _batch(5), decoder=name)
    assert _ids(r1) == _ids(r2)
    assert [[t.own_rows for t in r.traces] for r in r1] == [[t.own_rows for t in r.traces] for r in r2]
    assert _ids(r1) != _ids(r3)
    for req, r in zip(_batch(0).requests, r1):
        assert r.error is None and len(r.token_ids) <= req.max_tokens
        assert r.forwards == len(r.traces) and r.traces[0].kind == "encode"


@pytest.mark.parametrize("name", ["pipe", "funnel"])
def test_batched_equals_unbatched(bundle, name):
    """Each row has its own RNG (seed, custom_id), so batching changes only float summation
    order; in fp64 the tokens come out identical. (In fp32 the toy model's draft canvases, which
    ride many steps under draft-only pipelining, hold argmax near-ties that summation order flips.)"""
    b64 = tiny_bundle(peak=3.0)
    b64.hf_model.double()
    b64.d2f_model().double()
    for seed in (2, 3):
        batch = _batch(seed)
        together = run_batch(b64, batch, decoder=name)
        alone = [run_batch(b64, DecodeBatch([r], seed=batch.seed), decoder=name)[0] for r in batch.requests]
        assert _ids(together) == _ids(alone)


@pytest.mark.parametrize("name", ["pipe", "funnel"])
def test_forced_accept_bounds_forwards(bundle, name):
    """τ_conf = 1 never clears: only forced accept commits, one token per step on the front, so a
    canvas takes at most C decoder forwards; without forced accept the row never finishes."""
    C = bundle.canvas_length
    ov = {"tau_conf": 1.0, "max_canvases": 2}
    res = run_batch(bundle, _batch(1, n=2, max_tokens=16), decoder=name, overrides=ov)
    for r in res:
        assert r.error is None
        n_canvases = -(-(len(r.token_ids) or 1) // C)
        dec = [t for t in r.traces if t.kind == "decode"]
        assert len(dec) <= (n_canvases + 1) * C
        # the front commits every step; the funnel adds at most one ride per canvas in which a
        # finished front only waits to promote its last rows (promote one step late)
        idle = sum(t.own_commits == 0 for t in dec)
        assert idle <= (n_canvases if name == "funnel" else 0)
        assert r.stats["forced_accepts"] == len(dec) - idle
    stuck = run_batch(
        bundle, _batch(1, n=1, max_tokens=8), decoder=name, overrides={**ov, "forced_accept": False}
    )
    assert stuck[0].error is not None and "no progress" in stuck[0].error


def test_jacobi_restart_fires_on_stubborn_canvas(bundle):
    ov = {"tau_conf": 1.0, "max_canvases": 1}
    res = run_batch(bundle, _batch(1, n=1, max_tokens=8), decoder="pipe", overrides=ov)
    dec = sum(t.kind == "decode" for t in res[0].traces)
    # ≤ 1 commit per step throughout: one restart per 8 steps
    assert res[0].stats["jacobi_restarts"] == dec // 8 >= 1
    off = run_batch(
        bundle, _batch(1, n=1, max_tokens=8), decoder="pipe", overrides={**ov, "jacobi_window": 10_000}
    )
    assert off[0].stats.get("jacobi_restarts", 0) == 0
    # a shorter window fires mid-canvas (steps 3 and 6): the random restart changes the trajectory
    short = run_batch(
        bundle, _batch(1, n=1, max_tokens=8), decoder="pipe", overrides={**ov, "jacobi_window": 3}
    )
    assert short[0].stats["jacobi_restarts"] == 2
    assert short[0].token_ids != off[0].token_ids


def test_funnel_without_shrinking_is_the_pipe(bundle):
    shared = {"tau_conf": 0.8, "max_canvases": 3, "sc_topk": None}
    pipe = run_batch(bundle, _batch(3), decoder="pipe", overrides=shared)
    fun = run_batch(bundle, _batch(3), decoder="funnel", overrides={**shared, "shrink": False})
    assert _ids(pipe) == _ids(fun)
    assert [r.forwards for r in pipe] == [r.forwards for r in fun]
    shrunk = run_batch(bundle, _batch(3), decoder="funnel", overrides=shared)
    rows = lambda res: sum(t.own_rows for r in res for t in r.traces if t.kind == "decode")
    assert rows(shrunk) < rows(fun)  # the window does shrink when allowed


def test_arena_and_simple_promotion_give_identical_tokens(bundle):
    ov = {"tau_conf": 0.8, "max_canvases": 3}
    a = run_batch(bundle, _batch(4), decoder="funnel", overrides={**ov, "promote": "arena"})
    s = run_batch(bundle, _batch(4), decoder="funnel", overrides={**ov, "promote": "simple"})
    assert _ids(a) == _ids(s)
    assert all(r.stats["promoted"] > 0 for r in a)


def test_funnel_free_retire_and_refresh(bundle):
    ov = {"tau_conf": 0.8, "max_canvases": 2}
    free = run_batch(bundle, _batch(6, n=1, max_tokens=30), decoder="funnel", overrides=ov)[0]
    ref = run_batch(
        bundle, _batch(6, n=1, max_tokens=30), decoder="funnel", overrides={**ov, "retire_refresh": True}
    )[0]
    assert free.stats.get("free_retires", 0) >= 1
    assert sum(t.kind == "encode" for t in free.traces) == 1  # only the prefill
    assert ref.stats.get("refresh_retires", 0) >= 1
    assert sum(t.kind == "encode" for t in ref.traces) == 1 + ref.stats["refresh_retires"]


def test_pipe_retire_costs_an_encoder_pass(bundle):
    r = run_batch(bundle, _batch(6, n=1, max_tokens=30), decoder="pipe", overrides={"tau_conf": 0.8})[0]
    enc = [t for t in r.traces if t.kind == "encode"]
    assert r.stats["retired"] >= 1 and len(enc) == 1 + r.stats["retired"]
    assert all(t.own_rows == bundle.canvas_length for t in enc[1:])


def test_draft_spawn_and_states(bundle):
    ov = {"tau_conf": 0.8, "max_canvases": 3, "draft_only": False}  # the seed's graduation
    r = run_batch(bundle, _batch(7, n=1, max_tokens=40), decoder="pipe", overrides=ov)[0]
    states = [t.states for t in r.traces if t.kind == "decode"]
    assert all(s.split(",")[0] == "full" for s in states)  # the front is always full
    assert any("draft" in s for s in states)  # draft spawn before τ_add
    nodraft = run_batch(
        bundle, _batch(7, n=1, max_tokens=40), decoder="pipe", overrides={**ov, "draft_spawn": False}
    )[0]
    assert not any("draft" in t.states for t in nodraft.traces)


def test_tau_decay_and_early_spawn_are_live(bundle):
    base = {"tau_conf": 0.95, "max_canvases": 3, "draft_only": False}  # semi canvases decay too
    plain = run_batch(bundle, _batch(8, n=1, max_tokens=40), decoder="funnel", overrides=base)[0]
    decay = run_batch(
        bundle,
        _batch(8, n=1, max_tokens=40),
        decoder="funnel",
        overrides={**base, "tau_decay": True, "decay_after": 2},
    )[0]
    assert decay.stats.get("forced_accepts", 0) <= plain.stats.get("forced_accepts", 0)
    assert decay.forwards <= plain.forwards
    early = run_batch(
        bundle,
        _batch(8, n=1, max_tokens=40),
        decoder="funnel",
        overrides={**base, "early_spawn": True, "early_spawn_rows": 256},  # a whole canvas, scaled
    )[0]
    assert early.stats.get("early_spawns", 0) >= 1


def test_mix_renoise_and_topk_sc_run(bundle):
    r = run_batch(
        bundle, _batch(9), decoder="pipe", overrides={"renoise": "mix", "mix_fraction": 0.5, "sc_topk": 4}
    )
    assert all(x.error is None for x in r)
    a = run_batch(bundle, _batch(9), decoder="pipe", overrides={"renoise": "argmax"})
    assert _ids(r) != _ids(a)


def test_cancellation(bundle):
    calls = {"n": 0}

    def stop():
        calls["n"] += 1
        return calls["n"] > 3

    res = run_batch(bundle, _batch(0), decoder="funnel", should_stop=stop)
    assert all(r.error == CANCELLED and r.finish_reason == CANCELLED for r in res)


def _limit_at_step(dec, n: int | None) -> dict:
    """Fault injection: the worker's soft time limit fires inside `dec`'s n-th step (None: never).
    Returns the step counter."""
    orig, steps = dec.step, {"n": 0}

    def step(live):
        steps["n"] += 1
        if steps["n"] == n:
            raise SoftTimeLimitExceeded()
        return orig(live)

    dec.step = step
    return steps


@pytest.mark.parametrize("name", ["pipe", "funnel"])
def test_time_limit_inside_a_step_hands_back_finished_rows(bundle, name):
    def batch():
        return DecodeBatch([DecodeRequest("short", [2, 9, 4], 4), DecodeRequest("long", [2, 5, 6, 7, 4], 40)])

    steps = _limit_at_step(dec := make_decoder(name, bundle), None)
    full = dec.decode(batch())
    _limit_at_step(dec := make_decoder(name, bundle), steps["n"])  # the last step
    res = dec.decode(batch())  # not an interrupt: the rows of the failed forward error, the rest stand
    finished = [r.custom_id for r in res if r.error is None]
    assert len(finished) == 1 and all(r.error.startswith("SoftTimeLimitExceeded") for r in res if r.error)
    _limit_at_step(dec := make_decoder(name, bundle), steps["n"])
    with pytest.raises(Interrupted) as info:
        dec.decode(batch(), interrupts=(SoftTimeLimitExceeded,))
    assert isinstance(info.value.cause, SoftTimeLimitExceeded)
    assert [(r.custom_id, r.token_ids, r.forwards) for r in info.value.done] == [
        (r.custom_id, r.token_ids, r.forwards) for r in full if r.custom_id in finished
    ]


def test_time_limit_in_a_later_sub_batch_keeps_the_earlier_ones(bundle):
    """`auto` splits by task (the table: math → funnel, code → pipe); the limit fires at the last
    poll, inside the pipe sub-batch: the finished funnel row comes back with the interrupt."""
    batch = DecodeBatch(
        [DecodeRequest("m", [2, 9, 4], 8, "math"), DecodeRequest("c", [2, 5, 6, 4], 8, "code")]
    )
    should_stop, calls = stop_that_raises(SoftTimeLimitExceeded)

    table = {"math": "funnel", "code": "pipe"}
    full = run_batch(bundle, batch, decoder="auto", should_stop=should_stop, routing=table)
    assert [r.decoder for r in full] == ["funnel", "pipe"]
    calls.update(limit_at=calls["n"], n=0)
    with pytest.raises(Interrupted) as info:
        run_batch(
            bundle,
            batch,
            decoder="auto",
            should_stop=should_stop,
            interrupts=(SoftTimeLimitExceeded,),
            routing=table,
        )
    assert [(r.custom_id, r.token_ids) for r in info.value.done] == [("m", full[0].token_ids)]


def test_unknown_names_fail_loudly(bundle):
    with pytest.raises(UnknownDecoder):
        make_decoder("fast", bundle)
    with pytest.raises(ValueError, match="unknown PipeConfig"):
        run_batch(bundle, _batch(0), decoder="pipe", overrides={"tau_cnf": 0.5})
    with pytest.raises(ValueError):
        run_batch(bundle, _batch(0), decoder="funnel", overrides={"max_canvases": 6})


@pytest.fixture(scope="module")
def eos_bundle():
    """The tiny model with the EOS logit row boosted: EOS is often the argmax at middling confidence,
    the regime EOS priority is for."""
    b = tiny_bundle(peak=3.0)
    with torch.no_grad():
        b.hf_model.lm_head.weight[b.eos_id] *= 1.5
    return b


def _eos_batch():
    return DecodeBatch([DecodeRequest(f"r{i}", [2, 5 + i, 6 + i, 7, 8 + i, 4], 32) for i in range(6)], seed=0)


def test_eos_priority_stops_earlier(eos_bundle):
    plain = run_batch(eos_bundle, _eos_batch(), decoder="pipe", overrides={"tau_conf": 0.95})
    eos = run_batch(eos_bundle, _eos_batch(), decoder="pipe", overrides={"tau_conf": 0.95, "tau_eos": 0.3})
    assert sum(r.stats.get("eos_priority", 0) for r in eos) >= 1
    assert all(len(e.token_ids) <= len(p.token_ids) for e, p in zip(eos, plain))
    assert sum(r.forwards for r in eos) < sum(r.forwards for r in plain)
    streak = run_batch(
        eos_bundle,
        _eos_batch(),
        decoder="pipe",
        overrides={"tau_conf": 0.95, "tau_eos": 0.3, "eos_streak": True},
    )
    fired = lambda res: sum(r.stats.get("eos_priority", 0) for r in res)
    assert fired(streak) <= fired(eos)


def test_agree_mode_costs_forwards(eos_bundle):
    plain = run_batch(eos_bundle, _eos_batch(), decoder="funnel", overrides={"tau_conf": 0.7})
    agree = run_batch(eos_bundle, _eos_batch(), decoder="funnel", overrides={"tau_conf": 0.7, "agree": True})
    assert sum(r.stats.get("agree_blocked", 0) for r in agree) >= 1
    assert sum(r.forwards for r in agree) > sum(r.forwards for r in plain)


def test_failed_forward_errors_rows_without_raising(bundle):
    from canvasq.decoders.runtimes import runtime_for

    rt = runtime_for(bundle.hf_model, "bf16")

    def boom(*a, **k):
        raise RuntimeError("device lost")

    for method in ("encode_many", "decode"):
        setattr(rt, method, boom)
        try:
            res = run_batch(bundle, _batch(0), decoder="pipe", overrides={"adapter": False})
        finally:
            delattr(rt, method)
        assert all(r.error == "RuntimeError: device lost" and r.finish_reason == "error" for r in res)


def test_entropy_budget_caps_commits(eos_bundle):
    over = {"tau_conf": 0.7}
    plain = run_batch(eos_bundle, _eos_batch(), decoder="funnel", overrides=over)
    capped = run_batch(eos_bundle, _eos_batch(), decoder="funnel", overrides={**over, "entropy_budget": 0.05})
    assert sum(r.stats.get("entropy_capped", 0) for r in capped) >= 1
    assert sum(r.forwards for r in capped) > sum(r.forwards for r in plain)


def test_commit_window_commits_left_first(eos_bundle):
    """With a window of 1 the front canvas commits at most one token per forward, so a request
    takes at least as many forwards as tokens; without it the same bar commits several at once."""
    over = {"tau_conf": 0.5, "max_canvases": 1, "adapter": False}
    plain = run_batch(eos_bundle, _eos_batch(), decoder="pipe", overrides=over)
    left = run_batch(eos_bundle, _eos_batch(), decoder="pipe", overrides={**over, "commit_window": 1})
    assert sum(r.forwards for r in plain) < sum(len(r.token_ids) for r in plain)
    assert all(r.forwards >= len(r.token_ids) for r in left)


def _sc_ids(sc) -> list | None:
    """The discrete part of a window's self-conditioning: top-k ids (a near-tie there flips an id)."""
    return sc[0].tolist() if isinstance(sc, tuple) else None


def _same_forwards(got: list, want: list) -> int:
    """Compare two decodes' model passes (kind, inputs, logits) in order while their inputs agree:
    encoder passes (prefill, retired canvases) by their inputs only, decoder forwards by logits too.
    The first forward sees identical everything: fp32 summation-order noise only (9e-7 measured).
    Later ones also read the K/V and self-conditioning that their own earlier forwards wrote, so that
    noise compounds (about x3 a forward on the tiny model, 3e-3 at most over 15 forwards), and a row
    whose router top-k sits on a near-tie can take another expert (one row of 32 moved 0.21 on
    2026-11-30); a wrong slot, stale input or missing mask moves most rows by O(1). Returns how many
    forwards were compared."""
    n = 0
    for (gk, gi, g), (wk, wi, w) in zip(got, want):
        if (gk, gi) != (wk, wi):  # the schedules split: a commit went the other way
            break
        if gk == "forward":
            row_err = (g - w).abs().amax(-1) / w.abs().max()
            if n == 0:
                assert row_err.max().item() <= 1e-5, f"forward 0: {row_err.max().item():.2e}"
            else:
                close = (row_err <= 2e-2).float().mean().item()
                assert close >= 0.9, f"forward {n}: {close:.0%} of rows within 2e-2"
            n += 1
    return n


@pytest.mark.parametrize("name", ["pipe", "funnel"])
def test_graph_runner_decodes_like_eager(bundle, name, monkeypatch):
    """cuda_graphs="on" (on CPU: the prepared, padded, always-masked forwards a CUDA graph replays)
    computes the eager loop's logits, over one persistent arena whose graphs the next batch reuses;
    the funnel's simple promotion (another store) falls back to eager forwards.

    Padding changes the GEMM shapes, so the CPU BLAS may sum in another order: the two runs' logits
    must stay close at every forward (`_same_forwards`) until they split on a near-tie, and at least
    half of the forwards come before that split (a split seen: one row's last token, 75 against 60)."""
    from canvasq.decoders.base import StepDecoder
    from canvasq.decoders.runtimes import runtime_for

    logits: list[list] = []  # per decode: (kind, inputs, logits) per model pass
    plain_forward, plain_encode = StepDecoder.forward, StepDecoder.encode

    def recording(self, windows, **kw):
        out = plain_forward(self, windows, **kw)
        inputs = [(w.slot, w.token_ids.tolist(), w.positions.tolist(), _sc_ids(w.self_cond)) for w in windows]
        logits[-1].append(("forward", inputs, out.logits.detach().float().clone()))
        return out

    def recording_encode(self, items):
        logits[-1].append(("encode", [(slot, ids.tolist(), pos.tolist()) for slot, ids, pos in items], None))
        return plain_encode(self, items)

    monkeypatch.setattr(StepDecoder, "forward", recording)
    monkeypatch.setattr(StepDecoder, "encode", recording_encode)
    # the seed's semi canvases: under draft-only pipelining the toy model's long-lived drafts hold
    # argmax near-ties whose renoise flips split the compared schedules early
    ov = {"max_canvases": 2, "draft_only": False}
    logits.append([])
    eager = run_batch(bundle, _batch(3), decoder=name, overrides={**ov, "cuda_graphs": "off"})
    dec = make_decoder(name, bundle, {**ov, "cuda_graphs": "on"})
    runner = dec.graphs
    assert runner is not None and not runner.cuda_graph
    assert runner is runtime_for(dec.model, "bf16").graph_runner  # one per runtime, shared by tests
    before = dict(runner.stats)

    def grew():
        return {k: v - before[k] for k, v in runner.stats.items()}

    logits.append([])
    first = dec.decode(_batch(3))
    arena, built = runner.store, grew()["built"]
    compared, forwards = _same_forwards(logits[1], logits[0]), sum(k == "forward" for k, _, _ in logits[0])
    # the schedules may split on a near-tie (a commit, or a self-conditioning top-k id that changes
    # no token, e.g. a split at forward 6 of 10 with equal tokens); most must be compared
    assert compared >= forwards // 2, (compared, forwards)
    if compared == forwards:  # no split: the same tokens
        assert _ids(first) == _ids(eager)
    assert grew()["replayed"] > built > 0 and grew()["eager"] == grew()["failed"] == 0
    again = make_decoder(name, bundle, {**ov, "cuda_graphs": "on"}).decode(_batch(3))
    assert _ids(again) == _ids(first)
    assert runner.store is arena and grew()["built"] == built  # same shapes: no new capture
    if name == "funnel":
        knobs = {**ov, "cuda_graphs": "on", "promote": "simple"}
        simple = run_batch(bundle, _batch(3), decoder=name, overrides=knobs)
        assert grew()["eager"] > 0 and all(r.error is None for r in simple)


def test_graph_runner_grows_its_arena(bundle):
    """A batch that needs more slots or entries than the runner's arena gets a larger one (the graphs
    of the old one are dropped); a smaller batch keeps the larger arena."""
    from canvasq.model.arena import KVArena
    from canvasq.model.graph import GraphRunner

    runner = GraphRunner(make_decoder("pipe", bundle).rt, cuda_graph=False)
    assert runner.max_arena_bytes is None  # by default the stream's arena is the runner's, any size
    small = runner.arena(1, 10)
    assert runner.arena(1, 10) is small and (small.slots, small.capacity) == (1, 256)
    big = runner.arena(5, 300)
    assert big is not small and (big.slots, big.capacity) == (5, 512) and not runner.graphs
    assert runner.arena(2, 20) is big and all(n == 0 for n in big.length)
    assert big.nbytes() == KVArena.bytes_for(runner.rt.layer_shapes, 5, 512, runner.rt.dtype)
    # the byte cap: a batch whose arena would exceed it gets none (its decoder allocates its own and
    # runs eagerly); growing to cover both shapes is skipped when only the new one fits
    runner.max_arena_bytes = big.nbytes()
    assert runner.arena(6, 600) is None and runner.store is big
    wide = runner.arena(10, 200)
    assert (wide.slots, wide.capacity) == (10, 256) and wide.nbytes() == big.nbytes()
    # after an out-of-memory the runner lets go of its arena and graphs; the next batch gets a new one
    runner.graphs[("key",)] = None
    runner.release()
    assert runner.store is None and runner.logits is None and not runner.graphs
    assert runner.arena(2, 20) is not wide and runner.store is not None
    with pytest.raises(ValueError, match="cuda_graphs"):
        make_decoder("pipe", bundle, {"cuda_graphs": "yes"})


def test_graph_runner_runs_eagerly_what_a_graph_cannot_take(bundle):
    """Padded rows beyond a slot's free entries, or windows on another arena, run eagerly and give the
    eager forward's logits; a graph then serves what fits."""
    from canvasq.model.graph import GraphRunner
    from canvasq.model.runtime import Window

    rt = make_decoder("pipe", bundle).rt
    runner = GraphRunner(rt, cuda_graph=False)
    arena = runner.arena(1, 256)
    runner.encode_many(arena, [(0, torch.arange(250) % rt.vocab_size, torch.arange(250))])
    assert arena.length[0] == 250 and runner.stats["replayed"] == 1  # 250 rows: bucket 256 fits
    win = [Window.canvas(0, torch.arange(5) + 3, 250)]  # 5 rows fit, the 8-row bucket does not
    out = runner.decode(arena, win)
    assert runner.stats["eager"] == 1 and torch.equal(out.logits, rt.decode(arena, win).logits)
    assert runner.stats["failed"] == 0  # declined up front, not a capture that raised
    other = rt.new_arena(1, 64)
    rt.encode(other, 0, torch.arange(9) + 2, torch.arange(9))
    runner.decode(other, [Window.canvas(0, torch.arange(4) + 3, 9)])
    assert runner.stats["eager"] == 2 and runner.stats["built"] == 1
    # a logits buffer of 8 rows: a forward padded past it runs eagerly on the runner's arena, one
    # within it still replays
    runner.logits_bytes, runner.logits = 8 * 4 * rt.vocab_size, None
    runner.graphs.clear()
    assert runner.max_rows == 8 and not runner.takes(2, 5) and runner.takes(1, 5)
    arena = runner.arena(2, 256)
    runner.encode_many(arena, [(s, torch.arange(6) + s, torch.arange(6)) for s in (0, 1)])
    two = [Window.canvas(s, torch.arange(3) + 4, 6) for s in (0, 1)]
    out = runner.decode(arena, two)
    assert runner.eager_reasons["too many rows"] == 2 and torch.equal(
        out.logits, rt.decode(arena, two).logits
    )
    replayed = runner.stats["replayed"]
    runner.decode(arena, two[:1])
    assert runner.stats["replayed"] == replayed + 1


def test_a_forward_past_the_logits_buffer_replays_a_graph_with_its_head_deferred(bundle):
    """`deferred_rows`: a forward padded past the logits buffer (8 rows here) but within those rows
    replays a graph that stops at the hidden rows; its logits, made when read (all, or a row group's),
    are the eager forward's to rounding (the padded GEMMs may sum in another order), and the first
    windows of a padded forward keep their head deferred."""
    from canvasq.model.graph import GraphRunner
    from canvasq.model.runtime import Window

    rt = make_decoder("pipe", bundle).rt
    runner = GraphRunner(rt, cuda_graph=False, logits_bytes=8 * 4 * rt.vocab_size, deferred_rows=32)
    assert runner.max_rows == 8 and runner.takes(3, 8) and not runner.takes(5, 8)
    arena = runner.arena(3, 256)
    runner.encode_many(arena, [(s, torch.arange(6) + s, torch.arange(6)) for s in range(3)])
    assert runner.stats == {"built": 1, "replayed": 1, "eager": 0, "evicted": 0, "failed": 0}  # 3 x 8 rows
    wins = [Window.canvas(s, torch.arange(5) + 4 + s, 6) for s in range(3)]  # 3 x 8 padded rows
    out = runner.decode(arena, wins)
    assert out.deferred and runner.stats["built"] == 2 and runner.stats["eager"] == 0
    want = rt.decode(arena, wins).logits
    assert out.hidden.shape[0] == want.shape[0] == 15  # the real rows only
    torch.testing.assert_close(out.rows_logits(5, 10), want[5:10], rtol=1e-4, atol=1e-4)
    first = runner.decode(arena, wins).first(2)
    assert first.deferred and first.offsets == [0, 5, 10]
    torch.testing.assert_close(first.logits, want[:10], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out.logits, want, rtol=1e-4, atol=1e-4)
    assert runner.stats["replayed"] == 3 and runner.stats["built"] == 2
    full = runner.decode(arena, wins[:1])  # within the logits buffer: a graph with its head inside
    assert not full.deferred and runner.stats["built"] == 3


def test_graph_limits_changed_drop_the_graphs_and_unchanged_keep_them(bundle):
    """`set_limits`: a new logits buffer or `deferred_rows` releases the runner's graphs (they write the
    old buffer, and whether they defer their head follows from both); the same limits keep them."""
    from canvasq.model.graph import GraphRunner
    from canvasq.model.runtime import Window

    rt = make_decoder("pipe", bundle).rt
    runner = GraphRunner(rt, cuda_graph=False, logits_bytes=8 * 4 * rt.vocab_size)
    arena = runner.arena(1, 64)
    runner.decode(arena, [Window.canvas(0, torch.arange(5) + 4, 0)])
    assert len(runner.graphs) == 1
    runner.set_limits(8 * 4 * rt.vocab_size, runner.deferred_rows)
    assert len(runner.graphs) == 1 and runner.store is arena
    runner.set_limits(deferred_rows=32)
    assert runner.deferred_rows == 32 and not runner.graphs and runner.store is None
    runner.set_limits(logits_bytes=16 * 4 * rt.vocab_size)
    assert runner.max_rows == 16 and runner.deferred_rows == 32


def test_decoder_beyond_the_arena_cap_decodes_eagerly(bundle):
    """A batch whose arena would exceed the runner's byte cap gets its own arena: every forward runs
    eagerly and the tokens are the eager loop's."""
    runner = make_decoder("pipe", bundle, {"cuda_graphs": "on"}).graphs
    saved = runner.max_arena_bytes, runner.store, dict(runner.graphs)
    runner.max_arena_bytes, runner.store = 0, None
    runner.graphs.clear()
    try:
        before = runner.stats["eager"]
        capped = run_batch(bundle, _batch(1), decoder="pipe", overrides={"cuda_graphs": "on"})
        assert runner.store is None and runner.stats["eager"] > before
    finally:
        runner.max_arena_bytes, runner.store = saved[0], saved[1]
        runner.graphs.update(saved[2])
    assert _ids(capped) == _ids(
        run_batch(bundle, _batch(1), decoder="pipe", overrides={"cuda_graphs": "off"})
    )


def test_graph_build_failures_fall_back_but_interrupts_pass(bundle, monkeypatch):
    """A graph that fails to build (a RuntimeError, as a CUDA capture or out-of-memory error is) is
    counted and its forwards run eagerly; the worker's soft time limit raised during a capture is not
    swallowed: it ends the batch as `Interrupted`."""
    from canvasq.model import graph as graph_mod

    runner = make_decoder("pipe", bundle, {"cuda_graphs": "on"}).graphs
    saved = dict(runner.graphs)
    ov = {"cuda_graphs": "on", "max_canvases": 1}

    def fail(exc):
        def build(*a, **kw):
            raise exc

        return build

    try:
        runner.graphs.clear()
        monkeypatch.setattr(graph_mod, "DecodeGraph", fail(RuntimeError("capture failed")))
        failed = runner.stats["failed"]
        res = run_batch(bundle, _batch(2), decoder="pipe", overrides=ov)
        assert all(r.error is None for r in res) and runner.stats["failed"] > failed
        eager = run_batch(bundle, _batch(2), decoder="pipe", overrides={**ov, "cuda_graphs": "off"})
        assert _ids(res) == _ids(eager)
        runner.graphs.clear()
        monkeypatch.setattr(graph_mod, "DecodeGraph", fail(SoftTimeLimitExceeded()))
        with pytest.raises(Interrupted) as info:
            run_batch(bundle, _batch(2), decoder="pipe", overrides=ov, interrupts=(SoftTimeLimitExceeded,))
        assert isinstance(info.value.cause, SoftTimeLimitExceeded)
    finally:
        runner.graphs.clear()
        runner.graphs.update(saved)
