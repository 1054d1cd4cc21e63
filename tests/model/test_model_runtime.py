"""Parity of canvasq.model.runtime with HF's DiffusionGemma forward (fp32, CPU, rel. error <= 1e-4)
and the arena identities the decoders rely on."""

from __future__ import annotations

import pytest
import torch
from model_helpers import hf_decode, hf_encode, new_cache, random_model, rel_err, small_shape

from canvasq.model.experts import moe_reference
from canvasq.model.runtime import Runtime, Window

TOL = 1e-4

SHAPES = {
    # sliding window shorter than prompt + canvases: band masks matter
    "base": small_shape(),
    # more layers, V = K full layers with 2 KV heads, GQA 4:1 on sliding layers, wider window
    "deep": small_shape(
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=2,
        num_global_key_value_heads=2,
        sliding_window=24,
        canvas_length=12,
    ),
    # window shorter than one canvas
    "tiny_window": small_shape(sliding_window=5, canvas_length=8),
}


@pytest.fixture(scope="module", params=list(SHAPES))
def model(request):
    shape = SHAPES[request.param]
    m = random_model(shape, seed=len(request.param))
    return shape, m, Runtime.from_hf(m)


def _ids(g, n, vocab):
    return torch.randint(0, vocab, (n,), generator=g)


def _prompted_arena(rt, g, vocab, slots: int, capacity: int, prompts: dict[int, int]):
    """A new arena with a random prompt of `prompts[slot]` tokens encoded into each listed slot."""
    arena = rt.new_arena(slots, capacity)
    for slot, p in prompts.items():
        rt.encode(arena, slot, _ids(g, p, vocab), torch.arange(p))
    return arena


@pytest.mark.parametrize("prompt_len", [3, 21, 40])
def test_single_canvas_matches_hf(model, prompt_len):
    shape, m, rt = model
    g = torch.Generator().manual_seed(prompt_len)
    c, v = shape.canvas_length, shape.vocab_size
    prompt, canvas = _ids(g, prompt_len, v), _ids(g, c, v)
    cache = new_cache(m)
    hf_encode(m, cache, prompt, 0)
    arena = rt.new_arena(3, 256)
    rt.encode(arena, 2, prompt, torch.arange(prompt_len))
    sc = torch.randn(c, v, generator=g) * 4
    for sc_in in (None, sc):
        ref = hf_decode(m, cache, canvas, prompt_len, sc_logits=sc_in)
        out = rt.decode(arena, [Window.canvas(2, canvas, prompt_len, self_cond=sc_in)])
        assert out.logits.dtype == torch.float32
        assert rel_err(out.logits, ref) <= TOL
    assert arena.length[2] == prompt_len  # a decoder forward leaves the context untouched


def test_commit_then_next_canvas_matches_hf(model):
    """Prompt, then two canvases committed by encoder passes, then a third canvas decoded: positions
    run past the sliding window, so the HF cache has evicted what our band mask hides."""
    shape, m, rt = model
    g = torch.Generator().manual_seed(7)
    c, v = shape.canvas_length, shape.vocab_size
    p = 13
    prompt = _ids(g, p, v)
    canvases = [_ids(g, c, v) for _ in range(3)]
    cache = new_cache(m)
    arena = rt.new_arena(1, 256)
    hf_encode(m, cache, prompt, 0)
    rt.encode(arena, 0, prompt, torch.arange(p))
    start = p
    for cv in canvases[:2]:
        hf_encode(m, cache, cv, start)
        rt.encode(arena, 0, cv, torch.arange(start, start + c))
        start += c
    sc = torch.randn(c, v, generator=g) * 4
    ref = hf_decode(m, cache, canvases[2], start, sc_logits=sc)
    out = rt.decode(arena, [Window.canvas(0, canvases[2], start, self_cond=sc)])
    assert rel_err(out.logits, ref) <= TOL


def test_encoder_kv_matches_hf_cache(model):
    shape, m, rt = model
    g = torch.Generator().manual_seed(3)
    p = 30
    prompt = _ids(g, p, shape.vocab_size)
    cache = new_cache(m)
    hf_encode(m, cache, prompt, 0)
    arena = rt.new_arena(1, 64)
    rt.encode(arena, 0, prompt, torch.arange(p))
    for layer in range(rt.num_layers):
        k, v, pos = arena.prefix(0, layer)
        hk, hv = cache.layers[layer].keys[0], cache.layers[layer].values[0]
        n = hk.shape[1]  # sliding layers keep the last W - 1 entries
        assert rel_err(k[:, -n:], hk) <= TOL and rel_err(v[:, -n:], hv) <= TOL
        assert torch.equal(pos, torch.arange(p))


def _block_causal_hf_masks(m, cache, starts, c, w):
    """4D boolean masks ({layer type: [1, 1, Q, K]}) for HF's decoder over the concatenated canvases
    at `starts`, block-causal between canvases, sliding band canvas_start - (W - 1); cache columns
    carry the positions HF's cache holds (sliding layers: the last W - 1)."""
    tc = m.config.get_text_config()
    q_pos = torch.cat([torch.arange(s, s + c) for s in starts])
    q_lo = torch.cat([torch.full((c,), s) for s in starts])
    q_hi = q_lo + c
    masks = {}
    for lt in set(tc.layer_types):
        layer = tc.layer_types.index(lt)
        n_cached = cache.layers[layer].keys.shape[-2]
        total = (
            cache.layers[layer].get_seq_length() if hasattr(cache.layers[layer], "get_seq_length") else None
        )
        first = starts[0] - n_cached
        assert total is None or total == starts[0]
        k_pos = torch.cat([torch.arange(first, starts[0]), q_pos])
        vis = k_pos[None, :] < q_hi[:, None]
        if lt == "sliding_attention":
            vis &= k_pos[None, :] >= (q_lo - (w - 1))[:, None]
        masks[lt] = vis[None, None]
    return masks


@pytest.mark.parametrize("n_canvases", [2, 3])
def test_block_causal_window_matches_hf_masked(model, n_canvases):
    """D2F pipe window: several canvases of one sequence in one forward, block-causal. HF has no
    such call; its decoder with an explicit 4D mask over the concatenated canvases is the reference.
    The front canvas must also equal HF's plain single-canvas forward (it sees nothing behind it)."""
    shape, m, rt = model
    g = torch.Generator().manual_seed(11 + n_canvases)
    c, v, w = shape.canvas_length, shape.vocab_size, shape.sliding_window
    p = 19
    prompt = _ids(g, p, v)
    canvases = [_ids(g, c, v) for _ in range(n_canvases)]
    starts = [p + i * c for i in range(n_canvases)]
    cache = new_cache(m)
    hf_encode(m, cache, prompt, 0)
    arena = rt.new_arena(1, 256)
    rt.encode(arena, 0, prompt, torch.arange(p))
    sc = torch.randn(n_canvases * c, v, generator=g) * 4

    masks = _block_causal_hf_masks(m, cache, starts, c, w)
    ref = hf_decode(m, cache, torch.cat(canvases), p, sc_logits=sc, mask=masks)
    out = rt.decode(arena, [Window.blocks(0, list(zip(canvases, starts)), self_cond=sc)])
    assert rel_err(out.logits, ref) <= TOL
    front = hf_decode(m, cache, canvases[0], p, sc_logits=sc[:c])
    assert rel_err(out.logits[:c], front) <= TOL


def test_several_sequences_equal_each_alone(model):
    """Ragged windows on non-contiguous slots, mixed SC kinds, in one forward = each alone."""
    shape, _, rt = model
    g = torch.Generator().manual_seed(5)
    c, v = shape.canvas_length, shape.vocab_size
    arena = rt.new_arena(5, 256)
    specs = [(4, 9), (0, 33), (2, 17)]  # (slot, prompt length)
    windows = []
    for i, (slot, p) in enumerate(specs):
        rt.encode(arena, slot, _ids(g, p, v), torch.arange(p))
        r = c - 2 * i  # ragged
        ids = _ids(g, r, v)
        if i == 0:
            sc = None
        elif i == 1:
            sc = torch.randn(r, v, generator=g)
        else:
            top = torch.randn(r, v, generator=g).topk(5)
            sc = (top.indices, top.values)
        windows.append(Window.canvas(slot, ids, p, self_cond=sc))
    before = dict(rt.attention_paths)
    joint = rt.decode(arena, windows)
    assert rt.attention_paths["masked"] == before["masked"] + 1  # ragged contexts need the mask
    for i, w in enumerate(windows):
        alone = rt.decode(arena, [w]).logits
        assert rel_err(joint.window_logits(i), alone) <= TOL
    assert rt.attention_paths["maskfree"] == before["maskfree"] + 3  # one canvas after its context: none
    # encode_many equals encode one by one
    other = rt.new_arena(5, 256)
    items = [(s, _ids(g, 6 + s, v), torch.arange(6 + s)) for s in (1, 3)]
    rt.encode_many(other, items)
    for s, ids, pos in items:
        single = rt.new_arena(5, 256)
        rt.encode(single, s, ids, pos)
        for layer in range(rt.num_layers):
            assert rel_err(other.prefix(s, layer)[0], single.prefix(s, layer)[0]) <= TOL


def test_topk_self_conditioning_with_full_k_equals_full(model):
    shape, _, rt = model
    g = torch.Generator().manual_seed(9)
    c, v = shape.canvas_length, shape.vocab_size
    arena = rt.new_arena(1, 128)
    rt.encode(arena, 0, _ids(g, 10, v), torch.arange(10))
    canvas = _ids(g, c, v)
    logits = torch.randn(c, v, generator=g) * 5
    perm = torch.stack([torch.randperm(v, generator=g) for _ in range(c)])
    full = rt.decode(arena, [Window.canvas(0, canvas, 10, self_cond=logits)]).logits
    topk = rt.decode(arena, [Window.canvas(0, canvas, 10, self_cond=(perm, logits.gather(1, perm)))]).logits
    assert rel_err(topk, full) <= TOL
    # a truncated top-k is a different (renormalised) signal, but close when the mass is in the top
    peaked = logits.clone()
    peaked[:, :4] += 30
    small = rt.decode(
        arena, [Window.canvas(0, canvas, 10, self_cond=(torch.arange(4).expand(c, 4), peaked[:, :4]))]
    ).logits
    ref = rt.decode(arena, [Window.canvas(0, canvas, 10, self_cond=peaked)]).logits
    assert rel_err(small, ref) <= 1e-3


def test_self_cond_rows_zero_the_others(model):
    shape, _, rt = model
    g = torch.Generator().manual_seed(2)
    c, v = shape.canvas_length, shape.vocab_size
    arena = rt.new_arena(1, 128)
    rt.encode(arena, 0, _ids(g, 10, v), torch.arange(10))
    a, b = _ids(g, c, v), _ids(g, c, v)
    sc = torch.randn(2 * c, v, generator=g)
    rows = torch.cat([torch.zeros(c, dtype=torch.bool), torch.ones(c, dtype=torch.bool)])
    win = Window.blocks(0, [(a, 10), (b, 10 + c)], self_cond=sc, self_cond_rows=rows)
    out = rt.decode(arena, [win]).logits
    # the front canvas sees only the context: equals its SC-free single-canvas forward
    front = rt.decode(arena, [Window.canvas(0, a, 10)]).logits
    assert rel_err(out[:c], front) <= TOL
    # and the back canvas, with SC, equals the same window with SC on every row but the front's
    # SC logits replaced by anything (they are ignored)
    sc2 = sc.clone()
    sc2[:c] = torch.randn(c, v, generator=g) * 9
    win2 = Window.blocks(0, [(a, 10), (b, 10 + c)], self_cond=sc2, self_cond_rows=rows)
    assert torch.equal(rt.decode(arena, [win2]).logits, out)


def test_capture_promote_round_trip(model):
    """Promote one step late: rows whose K/V are captured must not depend on rows that stay in the
    window. Window 1 = finished rows F (causal: canvas_end = position + 1) + live rows X (see F).
    Capturing F, promoting it, then decoding X alone must reproduce X's logits exactly, because F's
    K/V never saw X. (Decoder K/V is *not* encoder K/V for the same ids: the decoder post-norms its
    input embeddings and uses its own layer_scalar, so the right identity is this one.)"""
    shape, _, rt = model
    g = torch.Generator().manual_seed(4)
    c, v = shape.canvas_length, shape.vocab_size
    p = 15
    arena = rt.new_arena(1, 256)
    rt.encode(arena, 0, _ids(g, p, v), torch.arange(p))
    nf = 3
    ids = _ids(g, c, v)
    pos = torch.arange(p, p + c)
    hi = torch.where(torch.arange(c) < nf, pos + 1, torch.full_like(pos, p + c))
    lo = torch.where(torch.arange(c) < nf, pos, torch.full_like(pos, p))
    capture = torch.arange(c) < nf
    sc = torch.randn(c, v, generator=g)
    w1 = Window(0, ids, pos, lo, hi, capture=capture, self_cond=sc)
    out1 = rt.decode(arena, [w1])
    cap = out1.captured[0]
    assert len(cap) == nf and torch.equal(cap.positions, pos[:nf])
    arena.promote(0, cap)
    assert arena.length[0] == p + nf
    x = ~capture
    w2 = Window(0, ids[x], pos[x], lo[x], hi[x], self_cond=sc[x])
    out2 = rt.decode(arena, [w2])
    assert rel_err(out2.logits, out1.logits[x]) <= TOL
    # promoting a subset / in another order keeps the identity (masks read positions, not order)
    arena.truncate(0, p)
    arena.promote(0, cap, rows=[2, 0, 1])
    assert rel_err(rt.decode(arena, [w2]).logits, out1.logits[x]) <= TOL


def test_compact_and_reset():
    shape = small_shape()
    m = random_model(shape)
    rt = Runtime.from_hf(m)
    g = torch.Generator().manual_seed(0)
    arena = rt.new_arena(2, 64)
    ids = _ids(g, 12, shape.vocab_size)
    rt.encode(arena, 1, ids, torch.arange(12))
    k0 = [arena.prefix(1, layer)[0].clone() for layer in range(rt.num_layers)]
    keep = torch.arange(12) % 3 != 0
    arena.compact(1, keep)
    assert arena.length[1] == 8
    assert torch.equal(arena.positions(1), torch.arange(12)[keep])
    for layer in range(rt.num_layers):
        assert torch.equal(arena.prefix(1, layer)[0], k0[layer][:, keep])
    arena.reset(1)
    assert arena.length[1] == 0
    with pytest.raises(ValueError):
        rt.encode(arena, 1, _ids(g, 65, shape.vocab_size), torch.arange(65))


def test_moe_reference_matches_hf_and_is_deterministic():
    shape = small_shape()
    m = random_model(shape)
    experts = m.model.decoder.layers[0].experts
    g = torch.Generator().manual_seed(1)
    x = torch.randn(37, shape.hidden_size, generator=g)
    ids = torch.stack(
        [torch.randperm(shape.num_experts, generator=g)[: shape.top_k_experts] for _ in range(37)]
    )
    w = torch.rand(37, shape.top_k_experts, generator=g)
    ref = experts(x, ids, w)
    ours = moe_reference(x, ids, w, experts.gate_up_proj, experts.down_proj)
    assert rel_err(ours, ref) <= TOL
    assert torch.equal(ours, moe_reference(x, ids, w, experts.gate_up_proj, experts.down_proj))


def test_grouped_experts_match_reference():
    """The grouped-GEMM expert path (the CUDA default) equals the per-expert loop, through a whole
    forward and on a skewed routing with empty experts."""
    from canvasq.model.experts import moe_grouped

    shape = small_shape()
    m = random_model(shape)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(29, shape.hidden_size, generator=g)
    ids = torch.stack(
        [torch.randperm(shape.num_experts, generator=g)[: shape.top_k_experts] for _ in range(29)]
    )
    ids[:, 0] = 5
    w = torch.rand(29, shape.top_k_experts, generator=g)
    ex = m.model.decoder.layers[1].experts
    assert (
        rel_err(
            moe_grouped(x, ids, w, ex.gate_up_proj, ex.down_proj),
            moe_reference(x, ids, w, ex.gate_up_proj, ex.down_proj),
        )
        <= TOL
    )
    outs = []
    for impl in ("reference", "grouped"):
        rt = Runtime.from_hf(m, experts=impl)
        arena = rt.new_arena(1, 64)
        rt.encode(arena, 0, torch.arange(20) % shape.vocab_size, torch.arange(20))
        outs.append(rt.decode(arena, [Window.canvas(0, torch.arange(8) + 3, 20)]).logits)
    assert rel_err(outs[1], outs[0]) <= TOL


def test_decode_graph_replays_like_decode(model):
    """DecodeGraph (CUDA graph on GPU; the same prepared forward on CPU) equals a fresh decode while
    the arena grows, the window shrinks within its bucket, capture rows and SC inputs change."""
    from canvasq.model.graph import DecodeGraph

    shape, _, rt = model
    g = torch.Generator().manual_seed(21)
    c, v = shape.canvas_length, shape.vocab_size
    arena = _prompted_arena(rt, g, v, 3, 160, {1: 12, 2: 30})

    def windows(rows_a, rows_b, ctx_a, ctx_b):
        a = Window.blocks(
            1,
            [(_ids(g, c, v), ctx_a), (_ids(g, c, v), ctx_a + c)],
            self_cond=torch.randn(2 * c, v, generator=g),
            capture=torch.arange(2 * c) % 5 == 0,
        )
        keep = torch.randperm(2 * c, generator=g)[:rows_a]
        a = Window(
            1,
            a.token_ids[keep],
            a.positions[keep],
            a.canvas_start[keep],
            a.canvas_end[keep],
            capture=a.capture[keep],
            self_cond=a.self_cond[keep],
        )
        top = torch.randn(rows_b, v, generator=g).topk(4)
        b = Window.canvas(2, _ids(g, rows_b, v), ctx_b, self_cond=(top.indices, top.values))
        return [a, b]

    graph = DecodeGraph(rt, arena, windows(2 * c, c, 12, 30), rows=2 * c, context=128)
    for step, (ra, rb) in enumerate(((2 * c, c), (c + 3, c - 2), (5, 1))):
        if step == 2:  # the contexts grow between steps; the graph keeps serving them
            rt.encode(arena, 1, _ids(g, 4, v), torch.arange(12, 16))
            rt.encode(arena, 2, _ids(g, 9, v), torch.arange(30, 39))
        ctx_a, ctx_b = arena.length[1], arena.length[2]
        ws = windows(ra, rb, ctx_a, ctx_b)
        out = graph.run(ws)
        ref = rt.decode(arena, ws)
        assert out.offsets == ref.offsets
        assert rel_err(out.logits, ref.logits) <= TOL
        if ref.captured[0] is not None:
            assert rel_err(out.captured[0].k[-1], ref.captured[0].k[-1]) <= TOL
            assert torch.equal(out.captured[0].positions, ref.captured[0].positions)
    with pytest.raises(ValueError):
        graph.run(windows(2 * c, c, 12, 30)[::-1])


def test_decode_graph_on_any_slots(model):
    """A graph built on non-consecutive slots indexes them on the device: it replays on any slots of
    the same count (rows finishing in any order keep it), reads each slot's own context, writes the
    logits into a shared buffer and copies them out; a graph on consecutive slots stays on them."""
    from canvasq.model.graph import DecodeGraph

    shape, _, rt = model
    g = torch.Generator().manual_seed(5)
    c, v = shape.canvas_length, shape.vocab_size
    arena = rt.new_arena(4, 96)
    for s, p in ((0, 7), (1, 19), (2, 11), (3, 26)):
        rt.encode(arena, s, _ids(g, p, v), torch.arange(p))

    def windows(slots, rows):
        return [Window.canvas(s, _ids(g, r, v), arena.length[s]) for s, r in zip(slots, rows)]

    buf = torch.full((2 * 16 * v + 5,), float("nan"))
    graph = DecodeGraph(rt, arena, windows([0, 2], [c, c]), rows=16, context=64, logits_out=buf)
    for slots, rows in (([0, 2], [c, 3]), ([3, 1], [5, c]), ([1, 2], [c, c])):
        ws = windows(slots, rows)
        out, ref = graph.run(ws), rt.decode(arena, ws)
        assert out.offsets == ref.offsets
        assert rel_err(out.logits, ref.logits) <= TOL
        assert out.logits.data_ptr() != buf.data_ptr()  # copied out: the next replay overwrites buf
    assert not torch.isnan(buf[: 2 * 16 * v]).all() and torch.isnan(buf[-5:]).all()
    fixed = DecodeGraph(rt, arena, windows([1, 2], [c, c]), rows=16, context=64)
    with pytest.raises(ValueError, match="built for slots"):
        fixed.run(windows([0, 2], [c, c]))


def test_decode_graph_uniform_steps_write_what_prepare_writes(model):
    """The decode loop's common step (one top-k SC canvas per window, each a full bucket) is written
    into the graph's buffers by a few batched copies (`DecodeGraph._write_uniform`), not through
    `prepare`: every buffer equals what `prepare` writes, over slots that change between steps,
    rows whose SC is off, and a padded step in between; the logits are the same."""
    from canvasq.model.graph import DecodeGraph

    shape, _, rt = model
    g = torch.Generator().manual_seed(8)
    c, v = shape.canvas_length, shape.vocab_size
    arena = _prompted_arena(rt, g, v, 4, 128, {0: 7, 1: 19, 2: 11, 3: 26})

    def windows(slots, rows=c, off=()):
        out = []
        for s in slots:
            top = torch.randn(rows, v, generator=g).topk(4)
            keep = torch.zeros(rows, dtype=torch.bool) if s in off else None
            out.append(
                Window.canvas(
                    s,
                    _ids(g, rows, v),
                    arena.length[s],
                    self_cond=(top.indices, top.values),
                    self_cond_rows=keep,
                )
            )
        return out

    fast = DecodeGraph(rt, arena, windows([0, 2]), rows=c, context=64)
    slow = DecodeGraph(rt, arena, windows([0, 2]), rows=c, context=64)
    slow.uniform = False
    assert fast.uniform and fast.any_slots
    # a padded step (through `prepare`) on other slots in between: the next uniform step must see it
    steps = (([0, 2], c, ()), ([3, 1], c, (1,)), ([1, 2], c - 3, ()), ([3, 1], c, ()), ([1, 2], c, (2,)))
    for slots, rows, off in steps:
        ws = windows(slots, rows, off)
        got, want = fast.run(ws), slow.run(ws)
        fp, sp = fast.prep, slow.prep
        for name in ("ids", "pos", "row_slot", "row_col"):
            assert torch.equal(getattr(fp, name), getattr(sp, name)), (name, slots)
        for name in ("slots", "hi", "lo", "ends", "pad"):
            assert torch.equal(getattr(fp.ctx, name), getattr(sp.ctx, name)), (name, slots)
        (_, keep_f, pay_f), (_, keep_s, pay_s) = fp.sc[0], sp.sc[0]
        assert torch.equal(keep_f, keep_s) and all(torch.equal(a, b) for a, b in zip(pay_f, pay_s))
        assert torch.equal(got.logits, want.logits)
        ref = rt.decode(arena, ws)
        assert rel_err(got.logits, ref.logits) <= TOL


def test_encoder_graph_writes_what_encode_many_writes(model):
    """An encoder DecodeGraph (padded rows, replayed as the contexts grow) leaves the same committed
    K/V and positions in the arena as `encode_many`, and returns no logits."""
    from canvasq.model.graph import DecodeGraph
    from canvasq.model.runtime import encoder_windows

    shape, _, rt = model
    g = torch.Generator().manual_seed(9)
    v = shape.vocab_size
    arenas = [rt.new_arena(2, 96) for _ in range(2)]
    graph = None
    for lens in ((13, 5), (7, 11)):  # prefill, then a second pass on top of it
        items = [
            (s, _ids(g, n, v), torch.arange(arenas[0].length[s], arenas[0].length[s] + n))
            for s, n in enumerate(lens)
        ]
        rt.encode_many(arenas[0], items)
        if graph is None:
            graph = DecodeGraph(rt, arenas[1], encoder_windows(items), rows=16, context=64, encoder=True)
        assert graph.run(encoder_windows(items)) is None
        for s, ids, _ in items:
            arenas[1].commit(s, ids.numel())
    assert arenas[0].length == arenas[1].length == [20, 16]
    for s in range(2):
        n = arenas[0].length[s]
        assert torch.equal(arenas[0].pos[s, :n], arenas[1].pos[s, :n])
        for layer in (0, rt.num_layers - 1):
            assert rel_err(arenas[1].prefix(s, layer)[0], arenas[0].prefix(s, layer)[0]) <= TOL
            assert rel_err(arenas[1].prefix(s, layer)[1], arenas[0].prefix(s, layer)[1]) <= TOL


def test_encoder_graph_writes_its_buffers_as_prepare_does(model):
    """An encoder graph's own writer (`_write_encoder`: one cat per buffer, bounds from positions) puts
    into the static buffers what `pad_window` + `prepare` (`_write`) put there, for windows of other
    rows, slots in another order and grown contexts; a window over the graph's rows is refused
    (a cat would resize the static buffers)."""
    from canvasq.model.graph import DecodeGraph
    from canvasq.model.runtime import encoder_windows

    shape, _, rt = model
    g = torch.Generator().manual_seed(11)
    v = shape.vocab_size
    arena = rt.new_arena(3, 96)
    for s, n in enumerate((9, 4, 12)):
        rt.encode_many(arena, [(s, _ids(g, n, v), torch.arange(n))])

    def items(lens):
        return [(s, _ids(g, n, v), torch.arange(arena.length[s], arena.length[s] + n)) for s, n in lens]

    graphs = [
        DecodeGraph(rt, arena, encoder_windows(items([(0, 3), (2, 16)])), rows=16, context=64, encoder=True)
        for _ in range(2)
    ]
    names = ("ids", "pos", "row_slot", "row_col")
    geometry = ("slots", "hi", "lo", "ends", "pad")
    for lens in ([(2, 5), (1, 16)], [(0, 1), (2, 7)], [(1, 8), (0, 11)]):
        ws = encoder_windows(items(lens))
        graphs[0]._write(ws)
        graphs[1]._write_encoder(ws)
        a, b = graphs[0].prep, graphs[1].prep
        for name in names:
            assert torch.equal(getattr(a, name), getattr(b, name)), (lens, name)
        for name in geometry:
            assert torch.equal(getattr(a.ctx, name), getattr(b.ctx, name)), (lens, name)
        rt.encode_many(arena, items(lens[:1]))  # a context grows between passes
    with pytest.raises(ValueError, match="17 rows in a 16-row graph"):
        graphs[1]._write_encoder(encoder_windows(items([(0, 17), (1, 2)])))


def test_decoder_kv_is_not_encoder_kv():
    """What "promote instead of re-encode" trades (seed: free front retire): decoder K/V of rows
    given causal visibility equal the encoder's at layer 0 only (its input RMSNorm makes the decoder's
    post-normed embeddings and the encoder's scaled embeddings equivalent); deeper layers differ,
    because the residual streams start at different scales. Pins the fact so nobody relies on it."""
    shape = small_shape()
    m = random_model(shape)
    rt = Runtime.from_hf(m)
    g = torch.Generator().manual_seed(0)
    p, ids = _ids(g, 20, shape.vocab_size), _ids(g, 8, shape.vocab_size)
    a = rt.new_arena(1, 64)
    rt.encode(a, 0, p, torch.arange(20))
    pos = torch.arange(20, 28)
    out = rt.decode(a, [Window(0, ids, pos, pos, pos + 1, capture=torch.ones(8, dtype=torch.bool))])
    b = rt.new_arena(1, 64)
    rt.encode(b, 0, torch.cat([p, ids]), torch.arange(28))
    enc_k = [b.prefix(0, layer)[0][:, 20:].transpose(0, 1) for layer in range(rt.num_layers)]
    assert rel_err(out.captured[0].k[0], enc_k[0]) <= TOL
    assert rel_err(out.captured[0].k[-1], enc_k[-1]) > 1e-2


def test_promote_window_equals_promote_of_captured():
    shape = small_shape()
    m = random_model(shape)
    rt = Runtime.from_hf(m)
    g = torch.Generator().manual_seed(8)
    c, v = shape.canvas_length, shape.vocab_size
    arenas = [rt.new_arena(2, 96) for _ in range(2)]
    prompt = _ids(g, 14, v)
    ids = _ids(g, c, v)
    capture = torch.zeros(c, dtype=torch.bool)
    capture[[1, 4, 5]] = True
    outs = []
    for arena in arenas:
        rt.encode(arena, 1, prompt, torch.arange(14))
        outs.append(rt.decode(arena, [Window.canvas(1, ids, 14, capture=capture)]))
    arenas[0].promote(1, outs[0].captured[0])
    arenas[1].promote_window(1, [1, 4, 5])
    assert arenas[0].length[1] == arenas[1].length[1] == 17
    for layer in range(rt.num_layers):
        for a, b in zip(arenas[0].prefix(1, layer), arenas[1].prefix(1, layer)):
            assert torch.equal(a, b)


def test_prefix_attention_takes_maskfree_path_only_when_exact():
    """Prefix attention: with every key visible to every row the mask is dropped (flash-eligible);
    a clipping sliding band or a block-causal window keeps it. Both paths match HF."""
    shape = small_shape(sliding_window=40)
    m = random_model(shape)
    rt = Runtime.from_hf(m)
    g = torch.Generator().manual_seed(12)
    c, v = shape.canvas_length, shape.vocab_size
    for p, expect in ((20, {False: True, True: True}), (50, {False: True, True: False})):
        prompt, canvas = _ids(g, p, v), _ids(g, c, v)
        arena = rt.new_arena(1, 128)
        rt.encode(arena, 0, prompt, torch.arange(p))
        prep = rt._prepare(arena, [Window.canvas(0, canvas, p)], encoder=False)
        logits = rt._run(prep)[0]
        assert prep.ctx.maskfree == expect
        assert _kernel_maskfree(prep) == expect  # the kernel path's detection, from its bounds alone
        cache = new_cache(m)
        hf_encode(m, cache, prompt, 0)
        assert rel_err(logits, hf_decode(m, cache, canvas, p)) <= TOL
    prep = rt._prepare(arena, [Window.blocks(0, [(canvas, p), (canvas, p + c)])], encoder=False)
    rt._run(prep)
    assert prep.ctx.maskfree == {False: False, True: False} == _kernel_maskfree(prep)


def test_ragged_contexts_mask_without_the_device_check():
    """The host's shortcut (`all_at_lmax`: a block seeing fewer than lmax entries always masks) gives
    what the device check gives, on both attention paths: equal contexts (checked on the device),
    ragged ones and a block-causal window (answered on the host, no sync)."""
    shape = small_shape(sliding_window=40)
    m = random_model(shape)
    rt = Runtime.from_hf(m)
    g = torch.Generator().manual_seed(13)
    c, v = shape.canvas_length, shape.vocab_size
    arena = rt.new_arena(3, 160)
    for s, p in enumerate((20, 20, 33)):
        rt.encode(arena, s, _ids(g, p, v), torch.arange(p))
    cases = {
        "equal": ([Window.canvas(s, _ids(g, c, v), 20) for s in (0, 1)], True),
        "ragged": ([Window.canvas(s, _ids(g, c, v), arena.length[s]) for s in (0, 1, 2)], False),
        "blocks": ([Window.blocks(0, [(_ids(g, c, v), 20), (_ids(g, c, v), 20 + c)])], True),
    }
    for name, (windows, at_lmax) in cases.items():
        for kernel in (False, True):
            prep = rt._prepare(arena, windows, encoder=False)
            assert prep.ctx.all_at_lmax == at_lmax, name
            arena.pos[prep.row_slot, prep.row_col] = prep.pos  # the rows' positions, as `_run` writes them
            prep.ctx.kernel = kernel
            prep.ctx.build_masks(arena, detect_maskfree=True)
            got = dict(prep.ctx.maskfree)
            prep.ctx.all_at_lmax = True  # the device check alone
            prep.ctx.build_masks(arena, detect_maskfree=True)
            assert got == prep.ctx.maskfree, (name, kernel)
            assert got == {False: name == "equal", True: name == "equal"}, (name, kernel)


def _kernel_maskfree(prep) -> dict[bool, bool]:
    """What `AttentionGeometry.build_masks` detects when the forward's attention is the kernel's."""
    prep.ctx.kernel = True
    prep.ctx.build_masks(prep.arena, detect_maskfree=True)
    assert prep.ctx.impl == "triton" and not prep.ctx.masks
    return prep.ctx.maskfree


def test_encoder_rows_ride_in_a_decoder_forward(model):
    """A window's leading `encoder_rows` (a retired canvas, causal) in a decoder forward beside a plain
    window: the logits of a separate encoder pass then the decoder forward, for both windows, and the
    same committed K/V in the arena (these models' encoder and decoder layer scalars differ)."""
    shape, _, rt = model
    assert not rt.tied_scalars
    g = torch.Generator().manual_seed(5)
    c, v, p = shape.canvas_length, shape.vocab_size, 9
    prompt, done, canvas = _ids(g, p, v), _ids(g, c, v), _ids(g, c, v)
    arena = rt.new_arena(2, 128)
    for slot in (0, 1):
        rt.encode(arena, slot, prompt, torch.arange(p))
    rt.encode(arena, 0, done, torch.arange(p, p + c))  # slot 0: the separate encoder pass
    separate = rt.decode(arena, [Window.canvas(0, canvas, p + c)])
    pos, cpos = torch.arange(p, p + c), torch.arange(p + c, p + 2 * c)
    riding = Window(
        1,
        torch.cat([done, canvas]),
        torch.cat([pos, cpos]),
        torch.cat([pos, torch.full_like(cpos, p + c)]),
        torch.cat([pos + 1, torch.full_like(cpos, p + 2 * c)]),
        encoder_rows=c,
    )
    out = rt.decode(arena, [Window.canvas(0, canvas, p + c), riding])
    assert out.offsets == [0, c, 2 * c] and out.logits.shape[0] == 2 * c
    assert rel_err(out.window_logits(1), separate.logits) <= TOL
    assert rel_err(out.window_logits(0), separate.logits) <= TOL
    assert arena.length[0] == arena.length[1] == p + c
    for layer in range(arena.num_layers):
        for a, b in zip(arena.prefix(0, layer), arena.prefix(1, layer)):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def _riding(slot, enc_ids, enc_start, canvas):
    """A window whose leading rows are an encoder pass of `enc_ids` at `enc_start`, then `canvas`."""
    e, c = enc_ids.numel(), canvas.numel()
    pos, cpos = torch.arange(enc_start, enc_start + e), torch.arange(enc_start + e, enc_start + e + c)
    return Window(
        slot,
        torch.cat([enc_ids, canvas]),
        torch.cat([pos, cpos]),
        torch.cat([pos, torch.full_like(cpos, enc_start + e)]),
        torch.cat([pos + 1, torch.full_like(cpos, enc_start + e + c)]),
        encoder_rows=e,
    )


@pytest.mark.parametrize("order", [(0, 1, 2), (2, 0, 1)], ids=["slot-order", "any-order"])
def test_riding_encoder_rows_of_any_length_keep_each_window_exact(model, order):
    """Encoder rows get query blocks of their own of at most a canvas's rows (a short prompt, a retired
    canvas, a long prompt in three blocks), so no window's queries are padded to its encoder rows plus
    a canvas: four windows (plain, a riding canvas, a short and a long riding prompt) in slot order
    (the windows' blocks read as a slice) and in another order (gathered) give each window the logits
    of separate passes."""
    shape, _, rt = model
    g = torch.Generator().manual_seed(8)
    c, v, p = shape.canvas_length, shape.vocab_size, 5
    prompt, done, canvas = _ids(g, p, v), _ids(g, c, v), _ids(g, c, v)
    ref = rt.new_arena(1, 128)
    rt.encode(ref, 0, prompt, torch.arange(p))
    fresh = rt.decode(ref, [Window.canvas(0, canvas, p)]).logits  # a prompt's first step
    rt.encode(ref, 0, done, torch.arange(p, p + c))
    later = rt.decode(ref, [Window.canvas(0, canvas, p + c)]).logits  # after a canvas's commit pass
    long = _ids(g, 2 * c + 3, v)  # a prompt longer than two canvases: three causal query blocks
    ref = rt.new_arena(1, 256)
    rt.encode(ref, 0, long, torch.arange(long.numel()))
    after_long = rt.decode(ref, [Window.canvas(0, canvas, long.numel())]).logits

    arena = rt.new_arena(4, 256)
    for slot in (0, 1):
        rt.encode(arena, slot, prompt, torch.arange(p))
    rt.encode(arena, 0, done, torch.arange(p, p + c))
    windows = {
        0: Window.canvas(0, canvas, p + c),
        1: _riding(1, done, p, canvas),
        2: _riding(2, prompt, 0, canvas),
        3: _riding(3, long, 0, canvas),
    }
    order = order + (3,)
    out = rt.decode(arena, [windows[k] for k in order])
    prep = rt._prepare(arena, [windows[k] for k in order], encoder=False)
    assert prep.ctx.rmax == c and bool(prep.ctx.sliced) == (order == (0, 1, 2, 3))
    assert prep.ctx.hi.shape[0] == 4 + 1 + 1 + 3  # the windows' blocks, then the encoder rows' blocks
    expect = {0: later, 1: later, 2: fresh, 3: after_long}
    for i, k in enumerate(order):
        assert rel_err(out.window_logits(i), expect[k]) <= TOL, k
    assert [arena.length[s] for s in range(4)] == [p + c, p + c, p, long.numel()]


@pytest.mark.parametrize("backend", ["auto", "math"])
def test_context_rounded_up_for_ragged_slots_keeps_logits(model, backend):
    """`context_step`: a masked eager forward (slots of different lengths) reads a context rounded up
    to a multiple of the step (so SDPA sees few distinct shapes); the extra entries are masked, so the
    logits are those of the exact context. Equal lengths keep the exact context (mask-free)."""
    shape, _, rt = model
    g = torch.Generator().manual_seed(9)
    c, v = shape.canvas_length, shape.vocab_size
    arena = _prompted_arena(rt, g, v, 2, 256, {0: 7, 1: 19})
    wins = [Window.canvas(0, _ids(g, c, v), 7), Window.canvas(1, _ids(g, c, v), 19)]
    exact = rt.decode(arena, wins).logits
    rt.context_step, rt.sdpa_backend = 64, backend
    try:
        prep = rt._prepare(arena, wins, encoder=False)
        assert prep.ctx.lmax == 64 and prep.ctx.backend == backend
        assert rel_err(rt.decode(arena, wins).logits, exact) <= TOL
        same = [Window.canvas(0, _ids(g, c, v), 7)]
        assert rt._prepare(arena, same, encoder=False).ctx.lmax == 7 + c
    finally:
        rt.context_step, rt.sdpa_backend = 0, "auto"


def test_encoder_model_keeps_a_decoder_only_change_out_of_the_encoder_passes():
    """A change merged into the (tied) decoder weights, as a LoRA merge makes it, reaches the encoder
    too; `encoder_model=` the unchanged model keeps the encoder passes on the base weights: its
    prompt K/V are the base model's, its decoder logits the changed model's over those K/V, the
    experts one copy, and encoder rows may not ride in a decoder forward (they would read the
    decoder's weights)."""
    import copy

    shape = small_shape()
    base = random_model(shape, seed=11)
    changed = copy.deepcopy(base)
    with torch.no_grad():
        for layer in changed.model.decoder.layers:
            w = layer.self_attn.q_proj.weight
            w.add_(0.1 * torch.randn(w.shape, generator=torch.Generator().manual_seed(1)))
            layer.mlp.down_proj.weight.add_(0.01)
    assert torch.equal(
        changed.model.encoder.language_model.layers[0].self_attn.q_proj.weight,
        changed.model.decoder.layers[0].self_attn.q_proj.weight,
    )  # tied: the merge reaches both
    rt_base, rt_changed = Runtime.from_hf(base), Runtime.from_hf(changed)
    rt = Runtime.from_hf(changed, encoder_model=base)
    assert rt_base.tied_weights and rt_changed.tied_weights and not rt.tied_weights
    assert all(e.gate_up is d.gate_up and e.down is d.down for e, d in zip(rt.enc_layers, rt.dec_layers))

    g = torch.Generator().manual_seed(3)
    c, v, p = shape.canvas_length, shape.vocab_size, 9
    prompt, canvas = _ids(g, p, v), _ids(g, c, v)
    arenas = {}
    for name, r in (("mixed", rt), ("base", rt_base), ("changed", rt_changed)):
        arenas[name] = r.new_arena(1, 64)
        r.encode(arenas[name], 0, prompt, torch.arange(p))
    last = arenas["mixed"].num_layers - 1
    for layer in range(last + 1):
        for a, b in zip(arenas["mixed"].prefix(0, layer), arenas["base"].prefix(0, layer)):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    # the changed encoder writes other keys
    assert not torch.allclose(arenas["mixed"].prefix(0, last)[0], arenas["changed"].prefix(0, last)[0])
    win = [Window.canvas(0, canvas, p)]
    mixed = rt.decode(arenas["mixed"], win).logits
    torch.testing.assert_close(mixed, rt_changed.decode(arenas["mixed"], win).logits, rtol=0, atol=0)
    assert rel_err(mixed, rt_changed.decode(arenas["changed"], win).logits) > TOL
    riding = Window(
        0,
        torch.cat([canvas, canvas]),
        torch.arange(p, p + 2 * c),
        torch.cat([torch.arange(p, p + c), torch.full((c,), p + c)]),
        torch.cat([torch.arange(p + 1, p + c + 1), torch.full((c,), p + 2 * c)]),
        encoder_rows=c,
    )
    with pytest.raises(ValueError, match="fold_encode=false"):
        rt.decode(arenas["mixed"], [riding])
