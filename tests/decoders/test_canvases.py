"""The canvas pipeline's mechanics (`decoders.canvases`) on hand-made canvases, without a model."""

from types import SimpleNamespace

import torch

from canvasq.decoders import canvases
from canvasq.decoders.canvases import SelfCond
from canvasq.decoders.state import Canvas

V = 11


def _canvas(index: int, start: int, committed: list[bool], state: str = "full") -> Canvas:
    n = len(committed)
    toks = torch.arange(100 * (index + 1), 100 * (index + 1) + n)
    return Canvas(index, start, toks, torch.tensor(committed), state)


def _open_rows(cv: Canvas) -> torch.Tensor:
    return torch.nonzero(~cv.committed).flatten()


def test_block_window_is_block_causal_and_leaves_out_canvases_without_rows():
    a = _canvas(0, 10, [True, False, False, True])
    done = _canvas(1, 14, [True] * 4)
    b = _canvas(2, 18, [False, True, False, False])
    parts = canvases.layout([a, done, b], _open_rows, lambda cv, idx: None)
    assert [p.cv for p in parts] == [a, b] and [p.off for p in parts] == [0, 2]
    w = canvases.block_window(3, parts, SelfCond(True, 4, V, torch.float32, "cpu"))
    assert w.slot == 3 and w.capture is None and w.self_cond is None  # nothing captured, no SC yet
    assert w.token_ids.tolist() == [101, 102, 300, 302, 303]
    assert w.positions.tolist() == [11, 12, 18, 20, 21]
    assert w.canvas_start.tolist() == [10, 10, 18, 18, 18]
    assert w.canvas_end.tolist() == [14, 14, 22, 22, 22]


def test_split_cuts_the_window_per_canvas_with_the_captured_offsets():
    a, b = _canvas(0, 0, [False] * 3), _canvas(1, 3, [False] * 2)
    parts = canvases.layout(
        [a, b], _open_rows, lambda cv, idx: torch.tensor([True, False, True][: idx.numel()])
    )
    logits = torch.randn(5, V, generator=torch.Generator().manual_seed(0))
    out = SimpleNamespace(window_logits=lambda b: logits, captured=["kv"])
    first, second = canvases.split(parts, out, 0)
    for co, rows in ((first, slice(0, 3)), (second, slice(3, 5))):
        probs = torch.softmax(logits[rows], -1)  # per canvas, as the pipe once took it
        assert torch.equal(co.probs, probs) and torch.equal(co.arg, probs.argmax(-1))
    assert first.captured is not None and first.captured[:2] == ("kv", 0)
    assert second.captured is not None and second.captured[:2] == ("kv", 2)  # after a's two captured rows


def test_self_cond_stores_per_canvas_and_gathers_for_the_next_window():
    for topk in (None, 3):
        sc = SelfCond(True, topk, V, torch.float32, "cpu")
        a, b = _canvas(0, 0, [False] * 4), _canvas(1, 4, [False] * 4)
        first = canvases.layout([a], _open_rows, lambda cv, idx: None)
        logits = torch.randn(4, V, generator=torch.Generator().manual_seed(1))
        sc.store(first, logits)
        a.committed[1] = True
        parts = canvases.layout([a, b], _open_rows, lambda cv, idx: None)  # b has no SC yet
        got, rows = sc.gather(parts)
        assert rows.tolist() == [True, True, True, False, False, False, False]
        keep = [0, 2, 3]
        if topk is None:
            assert torch.equal(got[:3], logits[keep]) and not got[3:].any()
        else:
            vals, ids = torch.topk(logits[keep], 3, dim=-1)
            assert torch.equal(got[0][:3], ids) and torch.equal(got[1][:3], vals)
            assert got[0].shape == (7, 3) and not got[1][3:].any()
    assert SelfCond(False, None, V, torch.float32, "cpu").gather(parts) == (None, None)


def test_renoise_argmax_mix_and_restart():
    cv = _canvas(0, 0, [False] * 6)
    rows, arg = torch.tensor([1, 3, 4]), torch.tensor([7, 8, 9])
    canvases.renoise(cv, rows, arg, torch.Generator().manual_seed(0), V, None, False)
    assert cv.tokens[rows].tolist() == [7, 8, 9] and cv.tokens[0] == 100
    canvases.renoise(cv, rows, arg, torch.Generator().manual_seed(0), V, 0.0, False)
    assert cv.tokens[rows].tolist() == [7, 8, 9]  # a mix share of 0 draws but keeps the argmax
    canvases.renoise(cv, rows, arg, torch.Generator().manual_seed(5), V, None, True)
    assert torch.equal(cv.tokens[rows], torch.randint(0, V, (3,), generator=torch.Generator().manual_seed(5)))


def test_entropy_cap_keeps_the_lowest_entropy_candidates():
    sure, half, flat = torch.tensor([1.0, 0.0, 0.0]), torch.tensor([0.5, 0.5, 0.0]), torch.full((3,), 1 / 3)
    probs = torch.stack([half, sure, flat, sure])  # entropies ln 2, 0, ln 3, 0
    newly = torch.tensor([True, True, True, False])
    kept, dropped = canvases.entropy_cap(newly, probs, 0.5)  # {0, ln 2}: Σ − max = 0; + ln 3: ln 2
    assert kept.tolist() == [True, True, False, False] and dropped == 1
    kept, dropped = canvases.entropy_cap(torch.tensor([False, False, True, False]), probs, 0.0)
    assert kept.tolist() == [False, False, True, False] and dropped == 0  # at least one


def test_graduate_by_the_predecessors_decode_fraction():
    def live():
        return [
            _canvas(0, 0, [True] * 3 + [False], "semi"),  # 0.75 decoded
            _canvas(1, 4, [True] * 2 + [False] * 2, "draft"),  # 0.5
            _canvas(2, 8, [False] * 4, "draft"),
        ]

    cvs = live()
    canvases.graduate(cvs, tau_add=0.5, tau_act=0.7, draft_only=False)
    assert [cv.state for cv in cvs] == ["full", "full", "semi"]
    cvs = live()
    canvases.graduate(cvs, tau_add=0.5, tau_act=0.7, draft_only=True)
    assert [cv.state for cv in cvs] == ["full", "draft", "draft"]
    assert canvases.front_prefix(cvs[0]) == 3 and canvases.front_prefix(_canvas(0, 0, [True] * 2)) == 2
