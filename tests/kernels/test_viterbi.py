"""The one-launch Viterbi (`kernels.viterbi`, what `DeviceGrammar.best` runs on CUDA) against the torch
twin (itself checked against the host's `Grammar.best` in tests/decoders/test_structured.py): rows from
different states and budgets, a budget that ends inside the canvas, rows read out of order from a
larger batch, and ties (a row of equal logits: the highest edge index must win, as the twin breaks them)."""

from __future__ import annotations

import pytest
import torch
from kernel_testutil import DEVICE

from canvasq.decoders.grammar_device import DeviceGrammar
from canvasq.decoders.structured import TokenTexts, compile_grammar, token_texts
from tests.decoders.helpers import TESTBED_DIR

ANSWER = {
    "type": "object",
    "properties": {"answer": {"type": "integer"}},
    "required": ["answer"],
    "additionalProperties": False,
}
C = 8


# block 2: three tied edges over two chunks (the merge of a state's chunks); tile 16: the chunks scored
# several tiles a position and a state's chunks read one at a time (both loops run more than once)
@pytest.mark.parametrize(("block", "tile"), [(32, None), (2, None), (2, 16)])
def test_the_kernel_gives_the_twins_paths_and_ends(block, tile):
    base = token_texts(str(TESTBED_DIR / "tokenizer.json"))
    # every text three times under three ids: each edge has two twins of equal gain where
    # the logits are equal, so on the row of equal logits the twin's rule (highest edge index) decides
    # (only the texts a document of ANSWER can use: the interpreter is slow)
    words = [t for t in base.texts if t is not None and set(t) <= set('{}":answer0123456789-')]
    texts = TokenTexts((*words, *words, *words, None, None), 3 * len(words), 3 * len(words) + 1)
    g = compile_grammar(ANSWER, texts)
    dg = DeviceGrammar(g, torch.device(DEVICE))
    V = len(texts.texts) + 3
    gen = torch.Generator().manual_seed(5)
    logits = (torch.randn(6, C, V, generator=gen) * 3).to(DEVICE)
    logits[4] = 0.0  # every token equally likely: ties everywhere
    mid = dg.best([g.start], logits[:1].double(), [8 * C])[1].tolist()  # a state inside the document
    rows = [(g.start, 8 * C), (mid[0], 7 * C), (g.start, g.min_tokens), (mid[0], C + 1), (g.start, 5 * C)]
    rows = [(q, b) for q, b in rows if g.dist[q] <= b]
    assert len(rows) >= 4 and mid[0] != g.start
    idx = torch.tensor([5, 1, 4, 2, 3][: len(rows)], device=DEVICE)
    states, budgets = [q for q, _ in rows], [b for _, b in rows]
    back = torch.stack([dg.back(C, b) for b in budgets])
    toks, ends = dg._best_kernel(states, logits, idx, back, block, tile)
    want_toks, want_ends = dg._best_torch(states, logits, idx, back)
    assert ends.tolist() == want_ends.tolist()
    assert toks.tolist() == want_toks.tolist()
    # as the decoder calls it: int32 columns, each row's backward sets read from the grammar's table
    dg.back_index(C, 3 * C)  # a budget placed first: the rows' places are not their order
    placed = torch.tensor([dg.back_index(C, b) for b in budgets], dtype=torch.int32, device=DEVICE)
    i32 = torch.int32
    got = dg._best_kernel(torch.tensor(states, dtype=i32, device=DEVICE), logits, idx.to(i32), dg.backs(C),
                          block, tile, back_rows=placed)  # fmt: skip
    assert placed.tolist() != list(range(len(rows)))
    assert (got[0].tolist(), got[1].tolist()) == (want_toks.tolist(), want_ends.tolist())
    (tie,) = [k for k, i in enumerate(idx.tolist()) if i == 4]
    twins = [t for t in toks[tie].tolist() if t < 3 * len(words)]
    assert twins  # the tie row's path has tokens that tie with their twins; the twin's rule picked these
