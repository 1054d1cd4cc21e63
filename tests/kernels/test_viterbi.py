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
from canvasq.kernels.viterbi import MAX_CLASSES
from tests.decoders.helpers import TESTBED_DIR

ANSWER = {
    "type": "object",
    "properties": {"answer": {"type": "integer"}},
    "required": ["answer"],
    "additionalProperties": False,
}
C = 8


# block 2: three tied edges over two chunks (the merge of a state's chunks); tile 16: the chunks scored
# several tiles a position and a state's chunks read one at a time (both loops run more than once);
# class_min 3: the pairs of three edges or more are classes (the real vocabulary's free text), each
# scored through its best member
@pytest.mark.parametrize(
    ("block", "tile", "class_min"),
    [(32, None, None), (2, None, None), (2, 16, None), (32, None, 3), (2, 16, 3)],
)
def test_the_kernel_gives_the_twins_paths_and_ends(block, tile, class_min):
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
    toks, ends = dg._best_kernel(states, logits, idx, back, block, tile, class_min=class_min)
    classes = dg._csr[(block, V, class_min)]["members"].shape[0]
    assert classes == (MAX_CLASSES if class_min else 0)  # no pair here spans half the vocabulary
    want_toks, want_ends = dg._best_torch(states, logits, idx, back)
    assert ends.tolist() == want_ends.tolist()
    assert toks.tolist() == want_toks.tolist()
    # as the decoder calls it: int32 columns, each row's backward sets read from the grammar's table
    dg.back_index(C, 3 * C)  # a budget placed first: the rows' places are not their order
    placed = torch.tensor([dg.back_index(C, b) for b in budgets], dtype=torch.int32, device=DEVICE)
    i32 = torch.int32
    got = dg._best_kernel(torch.tensor(states, dtype=i32, device=DEVICE), logits, idx.to(i32), dg.backs(C),
                          block, tile, back_rows=placed, class_min=class_min)  # fmt: skip
    assert placed.tolist() != list(range(len(rows)))
    assert (got[0].tolist(), got[1].tolist()) == (want_toks.tolist(), want_ends.tolist())
    (tie,) = [k for k, i in enumerate(idx.tolist()) if i == 4]
    twins = [t for t in toks[tie].tolist() if t < 3 * len(words)]
    assert twins  # the tie row's path has tokens that tie with their twins; the twin's rule picked these


def test_a_class_best_member_is_the_highest_edge_among_equal_logits_across_blocks():
    """`class_best` against torch: per (row, position, class) the best logit over the class's tokens and,
    among tokens of that logit, the member of highest edge index, with ties planted inside one block and
    across two (V over two of its blocks); rows read out of order."""
    from canvasq.kernels.viterbi import class_best

    gen = torch.Generator().manual_seed(3)
    B, C, V, KC = 4, 3, 2500, 3
    logits = torch.randn(B, C, V, generator=gen)
    members = torch.full((KC, V), -1, dtype=torch.int32)
    for k in range(KC):  # each class a random third of the tokens, edge indices a random permutation
        toks = torch.nonzero(torch.rand(V, generator=gen) < 0.33)[:, 0]
        members[k, toks] = torch.randperm(10_000, generator=gen)[: len(toks)].to(torch.int32)
    for b, c in ((0, 0), (2, 1)):  # two members tie at the top in different blocks, one in the same block
        toks = torch.nonzero(members[0] >= 0)[:, 0]
        far = (toks[0], toks[-1])  # a block apart
        near = (toks[-2], toks[-1])
        for t in far if b == 0 else near:
            logits[b, c, t] = 9.0
    rows = torch.tensor([2, 0, 3], dtype=torch.int32)
    best, arg = class_best(logits.to(DEVICE), rows.to(DEVICE), members.to(DEVICE))
    x = logits[rows.long()]  # [R, C, V]
    for k in range(KC):
        inside = members[k] >= 0
        xx = torch.where(inside, x, float("-inf"))
        want_best = xx.max(dim=-1).values
        at_top = (xx == want_best[..., None]) & inside
        want_arg = torch.where(at_top, members[k].long(), -1).max(dim=-1).values
        assert torch.equal(best[..., k].cpu(), want_best)
        assert arg[..., k].cpu().long().tolist() == want_arg.tolist()
    assert (logits[0, 0] == 9.0).sum() == 2 and best[1, 0, 0] == 9.0  # row 0 (r 1) holds the far tie


@pytest.mark.parametrize("class_min", [None, 374])
def test_the_default_layout_gives_the_twins_paths_without_a_class_launch_at_the_testbeds_vocabulary(
    class_min,
):
    """The product's call (no block, no class size given): `layout` picks the chunk size and, at the
    testbed's vocabulary, keeps the thought's free text (609 of 748 tokens) as edges, so no `class_best`
    launch is added to the step (`CLASS_MIN`); the paths and ends are the twin's, on rows that start
    before the thought and inside the document. With a class floor of half the vocabulary (the
    structured-output benchmark's `--class-min` arm) `layout` makes that free text a class, and the
    paths are still the twin's."""
    from canvasq.testbed.json_adapter import FORM_SCHEMAS

    texts = token_texts(str(TESTBED_DIR / "tokenizer.json"))
    g = compile_grammar(FORM_SCHEMAS["answer_totals"], texts, think=True)
    dg = DeviceGrammar(g, torch.device(DEVICE))
    V, budget = len(texts.texts), 6 * C
    gen = torch.Generator().manual_seed(7)
    logits = (torch.randn(3, C, V, generator=gen) * 3).to(DEVICE)
    brace, quote = texts.texts.index("{"), texts.texts.index('"')
    logits[1, :2, brace] += 9.0  # a row whose thought ends at once
    mid = g.walk(g.start, [brace, quote])  # inside the document: its first key opened
    states = [g.start, g.start, mid]
    rows = torch.tensor([0, 1, 2], device=DEVICE)
    back = torch.stack([dg.back(C, b) for b in (budget, budget, budget - C)])
    toks, ends = dg._best_kernel(states, logits, rows, back, class_min=class_min)
    layout = dg._csr[(None, V, class_min)]
    if class_min is None:
        assert layout["members"].shape[0] == 0, "a class at the testbed's vocabulary: one more launch a step"
    else:
        assert layout["members"].shape[0] >= 1, "the thought's free text is not a class"
    want_toks, want_ends = dg._best_torch(states, logits, rows, back)
    assert ends.tolist() == want_ends.tolist()
    assert toks.tolist() == want_toks.tolist()
