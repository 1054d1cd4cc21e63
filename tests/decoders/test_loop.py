"""The shared decode loop's pieces (`decoders.base`, `decoders.windows`) and the sampler's batched
helpers (`decoders.sampling`): a folded window's layout, the pass timer and its lazily read times,
where an answer ends, the Philox keys on the device and the slot state's reset."""

from __future__ import annotations

import random

import pytest
import torch
from helpers import tiny_bundle

from canvasq.decoders import DecodeBatch, DecodeRequest, run_batch
from canvasq.decoders.registry import make_decoder
from canvasq.decoders.sampling import SlotState, philox_key, philox_keys, stable_and_confident
from canvasq.decoders.state import Canvas, Seq
from canvasq.decoders.traces import PassTimer
from canvasq.decoders.windows import canvas_window


def test_folded_window_puts_the_encoder_rows_in_front():
    """Encoder rows ride causally in front of the canvas with no self-conditioning; the canvas keeps
    its bidirectional bounds and its own SC rows."""
    C, k = 4, 3
    toks, ids, pos = torch.arange(10, 10 + C), torch.tensor([7, 8]), torch.tensor([20, 21])
    sc = (torch.ones(C, k, dtype=torch.long), torch.ones(C, k))
    plain = canvas_window(5, toks, 22, sc)
    w = canvas_window(5, toks, 22, sc, None, (ids, pos))
    assert w.encoder_rows == 2 and w.rows == 2 + C and plain.encoder_rows == 0
    assert w.token_ids.tolist() == [7, 8, 10, 11, 12, 13]
    assert w.positions.tolist() == [20, 21, 22, 23, 24, 25]
    assert w.canvas_start.tolist() == [20, 21, 22, 22, 22, 22]
    assert w.canvas_end.tolist() == [21, 22, 26, 26, 26, 26]
    assert w.self_cond_rows.tolist() == [False, False, True, True, True, True]
    assert w.self_cond[0][:2].eq(0).all() and torch.equal(w.self_cond[1][2:], sc[1])
    bare = canvas_window(5, toks, 22, None, None, (ids, pos))
    assert bare.self_cond is None and bare.self_cond_rows is None


def test_timer_reads_later_and_pending_traces_settle():
    """On the CPU a pass's time is the block's wall time; `record` also takes the timer itself and
    fills the traces' ms when the loop settles (after the next step, or at the result)."""
    with PassTimer("cpu") as t:
        torch.randn(64, 64) @ torch.randn(64, 64)
    assert t.ms > 0
    b = tiny_bundle()
    res = run_batch(b, DecodeBatch([DecodeRequest("a", [2, 5, 6], 16)], seed=0), "official")[0]
    assert res.traces[0].kind == "encode" and all(tr.ms > 0 for tr in res.traces)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA events")
def test_cuda_timer_does_not_synchronise_the_pass():
    """The CUDA timer records events on the current stream: leaving the block does not wait for the
    work (the event is still pending), reading `ms` does, and the time is the GPU's."""
    x = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    with PassTimer(x.device) as t:
        for _ in range(20):
            x = x @ x
            x = x / x.norm()
    assert t._events is not None and not t._events[1].query()
    assert t.ms > 1.0 and t._events is None and t.ms == t.ms


def test_answer_ends_at_stop_last_canvas_or_max_tokens():
    b = tiny_bundle()
    dec = make_decoder("official", b)
    C = dec.C
    s = Seq(row=0, req=DecodeRequest("a", [2, 5], 3 * C), slot=0, gen=torch.Generator(), n_canvases=3)
    s.spawned, s.out = 1, [5] * C
    assert dec.answer_ends(s, [5] * C) is None
    assert dec.answer_ends(s, [5, b.eos_id] + [5] * (C - 2)) == "stop"
    assert dec.answer_ends(s, [5, b.pad_id] + [5] * (C - 2)) == "stop"
    s.spawned = 3
    assert dec.answer_ends(s, [5] * C) == "length"
    s.spawned, s.req.max_tokens = 1, C
    assert dec.answer_ends(s, [5] * C) == "length"


def test_philox_keys_on_the_device_are_the_scalar_keys():
    rnd = random.Random(0)
    seeds = [rnd.randrange(2**63) for _ in range(500)] + [0, 1, 2**63 - 1]
    canvases = [rnd.randrange(400) for _ in seeds]
    steps = [rnd.randrange(300) for _ in seeds]
    got = philox_keys(torch.tensor(seeds), torch.tensor(canvases), torch.tensor(steps)).tolist()
    assert got == [philox_key(*x) for x in zip(seeds, canvases, steps)]


def test_slot_state_reset_and_stability_history():
    """A reset slot starts over (steps left, history, inputs as the canvas's view); the others keep
    theirs. The stability test stops a canvas once its argmax held for S steps and it is confident."""
    st = SlotState(4, 3, 2, 2, 10, torch.float32, "cpu")
    st.left[:] = 7
    cv = Canvas(0, 5, torch.tensor([1, 2, 3]), torch.zeros(3, dtype=torch.bool), "full")
    st.reset([2], [2**64 - 5], [1], 48, [cv])
    assert st.left.tolist() == [7, 7, 48, 7] and st.seed[2] == -5 and st.canvas[2] == 1
    st.tokens[2] = torch.tensor([4, 5, 6])
    assert cv.tokens.tolist() == [4, 5, 6]
    hist, calm = st.history[[2]], torch.zeros(1, 3)
    a = torch.tensor([[1, 2, 3]])
    for expect in (False, False, True):
        stopped, hist = stable_and_confident(hist, a, calm, 0.005)
        assert stopped.tolist() == [expect]
    assert not stable_and_confident(hist, a, torch.ones(1, 3), 0.005)[0].item()
