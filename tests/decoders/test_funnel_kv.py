"""Funnel KV correctness: promote one step late, and band masks against HF's own attention."""

import pytest
import torch
from helpers import tiny_bundle

from canvasq.decoders import DecodeBatch, DecodeRequest
from canvasq.decoders.registry import make_decoder


@pytest.fixture(scope="module")
def bundle():
    return tiny_bundle(peak=3.0)


def _batch(seed=0):
    return DecodeBatch(
        [DecodeRequest("x", [2, 5, 6, 7, 8, 9, 10, 11, 12, 4], 24), DecodeRequest("y", [2, 9, 4], 20)],
        seed=seed,
    )


def _final_tokens(seq) -> dict[int, int]:
    out = {}
    for cv in seq.retired + seq.canvases:
        for i in torch.nonzero(cv.committed).flatten().tolist():
            out[cv.start + i] = int(cv.tokens[i])
    return out


def _layer0_kv(rt, tokens: list[int], positions: list[int]):
    """Layer-0 K/V of each token at its position, each row alone (no SC): what the cache must
    hold for a committed token with that final id."""
    from canvasq.model.runtime import Window

    arena = rt.new_arena(1, len(tokens) + 1)
    ids = torch.tensor(tokens)
    pos = torch.tensor(positions)
    w = Window(0, ids, pos, pos, pos + 1, capture=torch.ones(len(tokens), dtype=torch.bool))
    cap = rt.decode(arena, [w]).captured[0]
    return cap.k[0], cap.v[0]  # [n, h, d]


def _promoted_mismatches(dec) -> tuple[int, int]:
    bad = total = 0
    for s in dec.last_seqs:
        n = dec.arena.length[s.slot]
        pos = dec.arena.pos[s.slot, :n]
        sel = torch.nonzero(pos >= s.prompt_len).flatten()
        final = _final_tokens(s)
        positions = pos[sel].tolist()
        k_exp, v_exp = _layer0_kv(dec.rt, [final[p] for p in positions], positions)
        k_got = dec.arena.k[0][s.slot, :, sel].transpose(0, 1)  # [n, h, d]
        v_got = dec.arena.v[0][s.slot, :, sel].transpose(0, 1)
        ok = torch.isclose(k_got, k_exp, atol=1e-5).flatten(1).all(1) & torch.isclose(
            v_got, v_exp, atol=1e-5
        ).flatten(1).all(1)
        bad += int((~ok).sum())
        total += len(positions)
    return bad, total


def test_promote_one_step_late_caches_the_final_token():
    b = tiny_bundle(peak=3.0)
    # semi canvases commit (and promote) rows behind the front: the seed's schedule
    ov = {"tau_conf": 0.8, "max_canvases": 2, "self_conditioning": False, "draft_only": False}
    dec = make_decoder("funnel", b, ov)
    dec.decode(_batch(0))
    bad, total = _promoted_mismatches(dec)
    assert total > 10 and bad == 0

    # the same check catches promotion at decision time (K/V of the draft token in the input)
    eager = make_decoder("funnel", b, ov)
    eager.promote_late = False
    eager.decode(_batch(0))
    bad, total = _promoted_mismatches(eager)
    assert bad > 0


def _hf_reference_logits(model, arena, slot, window, sliding_window):
    """HF's decoder over the same keys (cache entries in arena order, then the window rows) with
    4-D masks written from the rule: key visible iff position < canvas_end, and on sliding layers
    also position ≥ canvas_start − (W − 1)."""
    from transformers import DynamicCache

    tc = model.config.get_text_config()
    cache = DynamicCache(config=tc)
    n = arena.length[slot]
    for i, layer in enumerate(cache.layers):
        layer.keys = arena.k[i][slot : slot + 1, :, :n].clone()
        layer.values = arena.v[i][slot : slot + 1, :, :n].clone()
        layer.is_initialized = True
        layer.dtype, layer.device = layer.keys.dtype, layer.keys.device
    key_pos = torch.cat([arena.pos[slot, :n], window.positions])  # [L]
    hi = window.canvas_end[:, None]
    lo = window.canvas_start[:, None] - (sliding_window - 1)
    full = key_pos[None, :] < hi  # [R, L]
    slide = full & (key_pos[None, :] >= lo)
    masks = {"full_attention": full[None, None], "sliding_attention": slide[None, None]}
    with torch.no_grad():
        out = model(
            decoder_input_ids=window.token_ids[None],
            cache=cache,
            decoder_attention_mask=masks,
            decoder_position_ids=window.positions[None],
        )
    return out.logits[0], bool((~slide & full).any())


def test_band_masks_match_reference_attention():
    b = tiny_bundle(peak=3.0)
    W = b.config.get_text_config().sliding_window
    dec = make_decoder(
        "funnel", b, {"tau_conf": 0.8, "max_canvases": 5, "self_conditioning": False, "draft_only": False}
    )
    rt = dec.rt
    seen = []
    real_decode = rt.decode

    def spy(arena, windows, **kw):
        out = real_decode(arena, windows, **kw)
        for i, w in enumerate(windows):
            n = arena.length[w.slot]
            span = int(w.positions.max()) + 1  # prompt + live canvases, in positions
            canvases = len(set(w.canvas_start.tolist()))
            if span > W and canvases >= 2 and n > 0:
                ref, clipped = _hf_reference_logits(b.hf_model, arena, w.slot, w, W)
                seen.append((canvases, clipped, float((out.window_logits(i) - ref).abs().max())))
        return out

    rt.decode = spy
    try:
        dec.decode(DecodeBatch([DecodeRequest("z", [2] + list(range(5, 17)) + [4], 40)], seed=3))
    finally:
        del rt.decode
    assert seen, "no forward had prompt + canvases beyond the sliding window"
    assert any(c >= 3 for c, _, _ in seen) and any(clipped for _, clipped, _ in seen)
    assert max(err for _, _, err in seen) < 1e-4
