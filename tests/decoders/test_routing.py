"""`--decoder auto` routing, the registry and typed configs."""

import pytest
from helpers import tiny_bundle

from canvasq.decoders import DecodeBatch, DecodeRequest, run_batch
from canvasq.decoders.configs import FunnelConfig, OfficialConfig, PipeConfig, with_overrides
from canvasq.decoders.registry import NAMES, UnknownDecoder, decoder_class
from canvasq.decoders.routing import Route, route, routing_table


def test_seed_defaults():
    p, f = PipeConfig(), FunnelConfig()
    assert (p.tau_add, p.tau_act, p.jacobi_window, p.jacobi_max_commits) == (0.5, 0.95, 8, 1)
    assert p.spawn_threshold == pytest.approx(0.35) and p.renoise == "argmax" and p.forced_accept
    assert PipeConfig(draft_spawn=False).spawn_threshold == 0.5
    assert p.draft_only and f.draft_only  # draft-only pipelining measured better (BENCHMARKS.md)
    assert (f.decay_after, f.decay_floor, f.early_spawn_rows) == (16, 0.45, 48)
    assert f.promote == "arena" and f.self_conditioning and not f.retire_refresh
    assert OfficialConfig().experts == "bf16" and OfficialConfig().seed_mode == "row"


def test_auto_never_trades_accuracy_without_a_table():
    """No routing entry: every task goes to the accurate sampler, whatever it is called."""
    for task in ("math", "arith", "code", "gsm8k", None, "poetry"):
        r = route(task)
        assert r.decoder == "official" and r.overrides == {} and r.source == "default"
    # the settings table names a decoder per task or per kind (math / code)
    assert route("arith", {"math": "funnel"}).decoder == "funnel"
    assert route("code", {"code": "pipe"}) == Route("pipe", {}, "settings")
    assert route("code", {"math": "pipe"}).decoder == "official"
    assert route("code", {"code": "auto"}).decoder == "official"
    rows = routing_table({"code": "pipe"})
    assert rows[0] == ("code", "pipe", "CANVASQ_ROUTING") and rows[-1][1] == "official"


def test_registry_is_explicit():
    assert NAMES == ("official", "hf", "pipe", "funnel", "phcd")
    for n in NAMES:
        assert decoder_class(n).name == n
    with pytest.raises(UnknownDecoder):
        decoder_class("auto")
    with pytest.raises(ValueError, match="unknown FunnelConfig option"):
        with_overrides(FunnelConfig(), {"promote_late": False})
    with pytest.raises(ValueError):
        PipeConfig(renoise="uniform")


def test_auto_splits_the_batch_by_task_and_keeps_order():
    b = tiny_bundle(peak=3.0)
    reqs = [
        DecodeRequest("m1", [2, 5, 6, 4], 8, "math"),
        DecodeRequest("c1", [2, 7, 8, 4], 8, "code"),
        DecodeRequest("m2", [2, 9, 10, 4], 8, "math"),
    ]
    res = run_batch(b, DecodeBatch(reqs, seed=0), decoder="auto")
    assert [r.custom_id for r in res] == ["m1", "c1", "m2"]
    assert [r.decoder for r in res] == ["official"] * 3
    res = run_batch(b, DecodeBatch(reqs, seed=0), decoder="auto", routing={"math": "funnel", "code": "pipe"})
    assert [r.custom_id for r in res] == ["m1", "c1", "m2"]
    assert [r.decoder for r in res] == ["funnel", "pipe", "funnel"]
    # per-request overrides apply on top of the routed knobs
    res = run_batch(
        b,
        DecodeBatch(reqs[:1], seed=0),
        decoder="auto",
        routing={"math": "funnel"},
        overrides={"max_canvases": 1},
    )
    assert all("," not in t.states for t in res[0].traces)


def test_answer_ends_at_eos_or_pad():
    from canvasq.decoders.state import first_stop

    stop = frozenset({1, 0})
    assert first_stop([5, 6, 1, 7], stop) == 2
    assert first_stop([5, 0, 1], stop) == 1  # a committed pad means the EOS was lost: padding follows
    assert first_stop([5, 6], stop) is None
