"""Structured output on canvases (issue 36): a schema's token automaton over the testbed's tokenizer,
the per-canvas masks (`Grammar.plan`) and the best completable path (`Grammar.best`), chained canvas by
canvas as `official` chains them; then `official` itself on the trained testbed with schemas: every
finished row parses and validates."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from canvasq.decoders import DecodeBatch, DecodeRequest, run_batch
from canvasq.decoders.constrained import INVALID, NEG, CanvasConstraints
from canvasq.decoders.grammar_device import DeviceGrammar
from canvasq.decoders.structured import Unfinishable, compile_grammar, split_thought, token_texts
from canvasq.decoders.types import DecodeResult
from canvasq.model.loading import load_bundle
from canvasq.testbed import tasks
from tests.decoders.helpers import TESTBED_DIR

TOKENIZER = str(TESTBED_DIR / "tokenizer.json")
C = 32
ANSWER = {
    "type": "object",
    "properties": {"answer": {"type": "integer"}},
    "required": ["answer"],
    "additionalProperties": False,
}
SIGN = {
    "type": "object",
    "properties": {"sign": {"enum": ["up", "down", "same"]}, "ok": {"type": "boolean"}},
    "required": ["sign", "ok"],
    "additionalProperties": False,
}
NESTED = {
    "type": "object",
    "properties": {
        "steps": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"op": {"enum": ["+", "-"]}, "n": {"type": "integer"}},
                "required": ["op", "n"],
                "additionalProperties": False,
            },
            "maxItems": 4,
        },
        "note": {"type": "string", "maxLength": 12},
    },
    "required": ["steps", "note"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def texts():
    return token_texts(TOKENIZER)


def _chain(grammar, logprobs: np.ndarray, budget: int) -> list[int]:
    """Canvases of C positions chained as `official` chains them: plan, best, next state."""
    state, out = grammar.start, []
    for k in range(0, logprobs.shape[0], C):
        masks = grammar.plan(state, C, budget - k)
        toks, state = grammar.best(state, logprobs[k : k + C], budget - k)
        assert all(masks[i, t] for i, t in enumerate(toks))  # the path keeps to the masks
        out += toks
    return out


def _text(ids: list[int], texts) -> str:
    end = ids.index(texts.eos)
    assert all(t in (texts.eos, texts.pad) for t in ids[end:])
    return Tokenizer.from_file(TOKENIZER).decode(ids[:end])


@pytest.mark.parametrize("schema", [ANSWER, SIGN, NESTED], ids=["integer", "enum", "nested"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_any_logits_give_a_valid_document_within_the_budget(texts, schema, seed):
    g = compile_grammar(schema, texts)
    budget = max(3 * C, g.min_tokens)
    rng = np.random.default_rng(seed)
    logprobs = np.log(rng.dirichlet(np.full(len(texts.texts), 0.05), size=-(-budget // C) * C) + 1e-30)
    ids = _chain(g, logprobs, budget)
    assert texts.eos in ids[:budget]
    jsonschema.validate(json.loads(_text(ids, texts)), schema)


def test_the_most_likely_valid_document_is_chosen(texts):
    """Log-probs peaked on a valid document (one near-tie digit the other way) give exactly it."""
    g = compile_grammar(ANSWER, texts)
    tk = Tokenizer.from_file(TOKENIZER)
    want = tk.encode('{"answer":36}', add_special_tokens=False).ids + [texts.eos]
    logprobs = np.full((C, len(texts.texts)), -20.0)
    for i, t in enumerate(want):
        logprobs[i, t] = -0.1
    logprobs[len(want) :, texts.pad] = -0.1
    logprobs[len(want) - 2, tk.token_to_id("7")] = -0.05  # a digit where '}' must come: argmax breaks it
    argmax = logprobs.argmax(axis=1).tolist()
    assert tk.decode(argmax[: argmax.index(texts.eos)]) == '{"answer":367'  # not JSON
    ids, end = g.best(g.start, logprobs, 64)
    assert end == g.done and _text(ids, texts) == '{"answer":36}'


def test_no_room_is_unfinishable(texts):
    g = compile_grammar(ANSWER, texts)
    assert g.min_tokens < len('{"answer":0}') + 1  # multi-character tokens ("an", "sw", "er"), and EOS
    with pytest.raises(Unfinishable):
        g.plan(g.start, C, g.min_tokens - 1)
    with pytest.raises(Unfinishable):
        g.best(g.start, np.zeros((C, len(texts.texts))), g.min_tokens - 1)
    ids, _ = g.best(g.start, np.zeros((C, len(texts.texts))), g.min_tokens)  # exactly enough
    assert ids.index(texts.eos) == g.min_tokens - 1 and json.loads(_text(ids, texts)) == {"answer": 0}


@pytest.mark.parametrize("schema", [ANSWER, SIGN, NESTED], ids=["integer", "enum", "nested"])
def test_the_device_automaton_gives_the_host_ones_masks_and_paths(texts, schema):
    """`grammar_device` (what `official` runs) against `Grammar.plan` / `Grammar.best` (the host
    reference) in float64: rows of one batch from different states and budgets, a budget that ends
    inside the canvas among them, give the same masks, tokens and end states."""
    g = compile_grammar(schema, texts)
    dg = DeviceGrammar(g, torch.device("cpu"))
    V = len(texts.texts) + 5  # the model's vocabulary padded past the tokenizer's
    rng = np.random.default_rng(3)

    def draw():
        return np.log(rng.dirichlet(np.full(V, 0.05), size=C) + 1e-30)

    _, mid = g.best(g.start, draw()[:, : len(texts.texts)], 4 * C)
    rows = [(g.start, 4 * C), (mid, 3 * C), (g.start, g.min_tokens), (mid, C + 3), (g.start, C + 7)]
    rows = [(q, b) for q, b in rows if g.dist[q] <= b]
    assert len(rows) >= 4 and mid != g.start
    logprobs = np.stack([draw() for _ in rows])
    for q, b in rows:
        want = np.zeros((C, V), dtype=bool)
        want[:, : len(texts.texts)] = g.plan(q, C, b)
        assert (dg.plan(q, C, b, V).numpy() == want).all()
    toks, ends = dg.best([q for q, _ in rows], torch.from_numpy(logprobs), [b for _, b in rows])
    for k, (q, b) in enumerate(rows):
        assert (toks[k].tolist(), int(ends[k])) == g.best(q, logprobs[k][:, : len(texts.texts)], b)
    with pytest.raises(Unfinishable):
        dg.plan(g.start, C, g.min_tokens - 1, V)


@pytest.fixture(scope="module")
def testbed():
    return load_bundle()


def test_official_rows_follow_their_schemas(testbed):
    problems = tasks.generate("arith", 3, 5, split="eval")
    schemas = [ANSWER, SIGN, None]
    reqs = [
        DecodeRequest(p.uid, testbed.encode_prompt(p.prompt, "arith"), 2 * C, "arith", schema)
        for p, schema in zip(problems, schemas)
    ]
    res = run_batch(testbed, DecodeBatch(reqs, seed=1), decoder="official", overrides={"cuda_graphs": "off"})
    for r, schema in zip(res, schemas):
        assert r.error is None, r
        if schema is not None:
            assert r.finish_reason == "stop", r
            jsonschema.validate(json.loads(r.text), schema)
            assert r.stats["constrained_canvases"] >= 1
        else:  # its neighbours' constraints leave it alone
            assert "constrained_canvases" not in r.stats and not r.text.startswith("{")


def test_constrained_rows_through_a_stream_of_few_slots(testbed):
    """The worker's loop: five rows through two slots, so rows enter slots that constrained and free rows
    left mid-stream. Each constrained row ends valid, each free row is left alone (a grammar kept for a
    finished row would constrain the row that takes its slot), and each row's text is the one it gets
    decoded alone."""
    from canvasq.decoders import make_decoder
    from canvasq.decoders.slots import drain

    problems = tasks.generate("arith", 5, 7, split="eval")
    schemas = [ANSWER, None, SIGN, None, ANSWER]
    reqs = [
        DecodeRequest(p.uid, testbed.encode_prompt(p.prompt, "arith"), 2 * C, "arith", schema)
        for p, schema in zip(problems, schemas)
    ]
    dec = make_decoder("official", testbed, {"cuda_graphs": "off"})
    got = dict(enumerate(drain(dec, reqs, 2, 3)))
    assert sorted(got) == list(range(5))
    for k, schema in enumerate(schemas):
        r = got[k]
        assert r.error is None, r
        if schema is not None:
            assert r.finish_reason == "stop", r
            jsonschema.validate(json.loads(r.text), schema)
            assert r.stats["constrained_canvases"] >= 1
        else:
            assert "constrained_canvases" not in r.stats and "{" not in r.text, r
        alone = run_batch(
            testbed, DecodeBatch([reqs[k]], seed=3), decoder="official", overrides={"cuda_graphs": "off"}
        )
        assert alone[0].text == r.text


def test_a_settled_canvas_is_pinned_and_stays_valid(testbed):
    """constraint_settle pins a canvas whose best valid path holds; off, the canvas runs its own course
    (the prefix rule off: with it, the held prefix can cover the canvas first)."""
    problems = tasks.generate("arith", 2, 6, split="eval")
    reqs = [
        DecodeRequest(p.uid, testbed.encode_prompt(p.prompt, "arith"), C, "arith", SIGN) for p in problems
    ]
    for settle in (2, None):
        overrides = {"cuda_graphs": "off", "constraint_settle": settle, "constraint_settle_positions": None}
        for r in run_batch(testbed, DecodeBatch(reqs, seed=2), decoder="official", overrides=overrides):
            assert r.error is None and r.finish_reason == "stop", r
            jsonschema.validate(json.loads(r.text), SIGN)
            assert (r.stats.get("constraint_pinned_steps", 0) > 0) == (settle is not None), r.stats


def test_the_document_step_cap_is_given_for_a_256_token_canvas(testbed):
    """`OfficialConfig.constraint_max_steps` is scaled to the model's canvas (`canvas_rows`): the
    default 48, HF's own step cap at 256 tokens, pins a document canvas at its 6th step on the
    testbed's 32; a value of its own scales the same way, and None turns the cap off."""
    from canvasq.decoders import make_decoder
    from canvasq.decoders.configs import OfficialConfig

    assert testbed.canvas_length == 32 and OfficialConfig().constraint_max_steps == 48
    assert make_decoder("official", testbed).constraints.max_steps == 6
    assert make_decoder("official", testbed, {"constraint_max_steps": 96}).constraints.max_steps == 12
    assert make_decoder("official", testbed, {"constraint_max_steps": None}).constraints.max_steps is None


def test_a_canvas_pinned_whole_ends_in_that_step(testbed, monkeypatch):
    """A canvas the settle rule pins at every position stops in that step, on the tokens the stability
    rule would have ended it on a step later: the same texts, a forward fewer per such canvas."""
    import canvasq.decoders.constraint_rules as rules

    problems = tasks.generate("arith", 4, 6, split="eval")
    reqs = [
        DecodeRequest(p.uid, testbed.encode_prompt(p.prompt, "arith"), C, "arith", SIGN) for p in problems
    ]
    overrides = {"cuda_graphs": "off", "constraint_settle": 2, "constraint_settle_positions": None}
    now = run_batch(testbed, DecodeBatch(reqs, seed=2), decoder="official", overrides=overrides)
    monkeypatch.setattr(rules, "pinned_whole", lambda pins: torch.zeros(len(pins), dtype=torch.bool))
    later = run_batch(testbed, DecodeBatch(reqs, seed=2), decoder="official", overrides=overrides)
    assert [r.text for r in now] == [r.text for r in later]
    assert all(r.stats.get("constraint_pinned_steps", 0) > 0 for r in now), [r.stats for r in now]
    assert all(a.forwards <= b.forwards for a, b in zip(now, later))
    assert sum(r.forwards for r in now) < sum(r.forwards for r in later), [r.forwards for r in now]


def test_an_invalid_document_is_an_error_not_a_done_row(testbed):
    checks = CanvasConstraints(testbed, C, len(token_texts(TOKENIZER).texts), testbed.hf_model.device)

    class Row:
        row, req = 0, DecodeRequest("x", [1], C, None, ANSWER)

    bad = checks.checked(Row(), DecodeResult("x", [5], '{"answer":"4"}', "stop", 3, 4))  # type: ignore[arg-type]
    assert bad.error_code == INVALID and bad.finish_reason == "error" and "does not match" in bad.error
    good = checks.checked(Row(), DecodeResult("x", [5], '{"answer":4}', "stop", 3, 4))  # type: ignore[arg-type]
    assert good.error is None and good.finish_reason == "stop"


def test_a_thinking_row_writes_free_text_then_its_document(texts, testbed):
    """`DecodeRequest.think` (a line's reasoning_effort): the automaton takes free text (no "{" or "[") before the document, so any
    logits still end in a valid document within the budget; official's row then returns the document
    as its text and the free text before it as its reasoning. The base testbed writes its working
    there, as it does unconstrained."""
    g = compile_grammar(ANSWER, texts, think=True)
    assert g.min_tokens == compile_grammar(ANSWER, texts).min_tokens  # the thought may be empty
    rng = np.random.default_rng(4)
    budget = 3 * C
    ids = _chain(g, np.log(rng.dirichlet(np.full(len(texts.texts), 0.05), size=budget) + 1e-30), budget)
    thought, doc = split_thought(_text(ids, texts))
    assert "{" not in thought and "[" not in thought
    jsonschema.validate(json.loads(doc), ANSWER)

    problems = tasks.generate("arith", 2, 5, split="eval")
    reqs = [
        DecodeRequest(p.uid, testbed.encode_prompt(p.prompt, "arith"), 6 * C, "arith", ANSWER, think=True)
        for p in problems
    ]
    overrides = {"cuda_graphs": "off"}
    for r in run_batch(testbed, DecodeBatch(reqs, seed=1), decoder="official", overrides=overrides):
        assert r.error is None and r.finish_reason == "stop", r
        jsonschema.validate(json.loads(r.text), ANSWER)
        assert r.reasoning and (" + " in r.reasoning or " - " in r.reasoning), r.reasoning  # its working
        assert 0 < r.reasoning_tokens < len(r.token_ids)


def _one_hot(texts, text: str) -> tuple[torch.Tensor, list[int]]:
    """[1, C, V] logits that favour `text`, EOS and padding by 8 nats at every position, and its ids."""
    ids = Tokenizer.from_file(TOKENIZER).encode(text).ids + [texts.eos]
    ids = ids + [texts.pad] * (C - len(ids))
    out = torch.zeros(1, C, len(texts.texts))
    out[0, torch.arange(C), torch.tensor(ids)] = 8.0
    return out, ids


def _pinned(checks, seq, x: torch.Tensor) -> list[int]:
    """The positions `checks.mask` pins (one-hot) in a copy of `x`."""
    x = x.clone()
    checks.mask([seq], x)
    return [c for c in range(C) if (x[0, c] == NEG).sum() == x.shape[-1] - 1]


def test_a_document_canvas_is_pinned_at_max_steps_and_a_thought_is_not(texts, testbed):
    """constraint_max_steps: a canvas whose best valid path has a document and never holds is pinned
    whole at its max_steps-th step, and to that path on every step after (a canvas pinned whole ends in
    that step in the decoder); a canvas whose path is thought only runs on."""
    from collections import Counter
    from types import SimpleNamespace

    from canvasq.decoders.constrained import RowGrammar
    from canvasq.decoders.structured import cached_grammar

    a, ids_a = _one_hot(texts, 'so 12 eggs\n{"answer":12}')
    b, _ = _one_hot(texts, 'so 13 eggs\n{"answer":13}')
    t, _ = _one_hot(texts, "so 12 eggs and 13 more eggs make 25 eggs so far and")
    grammar = cached_grammar(ANSWER, texts, True)
    for max_tokens, steps, pinned_at in ((C, [a, b, a, b], 2), (3 * C, [t, t, t, t], None)):
        checks = CanvasConstraints(testbed, C, len(texts.texts), torch.device("cpu"), settle=2, max_steps=3)
        checks.rows[0] = RowGrammar(
            grammar, grammar.start, torch.zeros(C, len(texts.texts), dtype=torch.bool)
        )
        req = SimpleNamespace(think=True, max_tokens=max_tokens)
        seq = SimpleNamespace(row=0, slot=0, req=req, stats=Counter(), canvases=[SimpleNamespace(index=0)])
        got = [_pinned(checks, seq, x) for x in steps]
        for k, pins in enumerate(got):
            assert pins == (list(range(C)) if pinned_at is not None and k >= pinned_at else []), (
                max_tokens,
                k,
            )
        counters = checks.counters(seq)  # type: ignore[arg-type]
        assert counters["constraint_capped_steps"] == (pinned_at is not None)
        assert counters["constraint_pinned_steps"] == 0  # the path never held: only the cap pinned it
        if pinned_at is not None:  # the last step read b's logits: the canvas still ends on a's path
            assert checks.final([seq], torch.zeros(1, C, dtype=torch.long)) == [ids_a]  # type: ignore[list-item]
            assert seq.stats["constraint_capped_steps"] == 1 and "constraint_pinned_steps" not in seq.stats


def test_settled_document_positions_are_pinned_alone(texts, testbed):
    """constraint_settle_positions: the document's positions whose tokens on the best valid path have
    held that many steps are pinned (one-hot logits) from its start up to the first that keeps changing,
    which stays open with all after it, as does the thought before the document; the whole canvas is
    pinned only once all of it holds."""
    from collections import Counter
    from types import SimpleNamespace

    from canvasq.decoders.constrained import RowGrammar
    from canvasq.decoders.structured import cached_grammar

    V = len(texts.texts)

    def logits_for(text: str) -> tuple[torch.Tensor, list[int]]:
        return _one_hot(texts, text)

    a, ids_a = logits_for('so 12 eggs\n{"answer":12}')
    b, ids_b = logits_for('so 13 eggs\n{"answer":13}')
    differ = [c for c in range(C) if ids_a[c] != ids_b[c]]
    first = next(c for c, t in enumerate(ids_a) if "{" in (texts.texts[t] or ""))
    assert len(differ) == 2 and differ[0] < first < differ[1]  # one digit in the thought, one in the document

    checks = CanvasConstraints(testbed, C, V, torch.device("cpu"), settle=2, settle_positions=1)
    grammar = cached_grammar(ANSWER, texts, True)
    row = checks.rows[0] = RowGrammar(grammar, grammar.start, torch.zeros(C, V, dtype=torch.bool))
    req = SimpleNamespace(think=True, max_tokens=C)
    seq = SimpleNamespace(row=0, slot=0, req=req, canvases=[SimpleNamespace(index=0)], stats=Counter())
    pinned = []
    for step, x in enumerate([a, b, a, b]):
        x = x.clone()
        checks.mask([seq], x)  # type: ignore[list-item]
        pinned.append([c for c in range(C) if (x[0, c] == NEG).sum() == V - 1])
        assert checks.best_of(seq)[0] == (ids_a if step % 2 == 0 else ids_b)  # type: ignore[arg-type]
    assert pinned[0] == []  # nothing has held yet
    assert pinned[1] == list(range(first, differ[1]))  # the document's held prefix
    counters = checks.counters(seq)  # type: ignore[arg-type]
    assert counters["constraint_pinned_steps"] == 0 and counters["constraint_pinned_positions"] > 0
    for x in (a, a, a):  # the path holds whole: the canvas is pinned, thought included
        x = x.clone()
        checks.mask([seq], x)  # type: ignore[list-item]
    counters = checks.counters(seq)  # type: ignore[arg-type]
    assert counters["constraint_pinned_steps"] == 1 and ((x[0] == NEG).sum(-1) == V - 1).all()
    # the canvas ends on this step's best valid path, whatever tokens the sampler last held
    assert checks.final([seq], torch.zeros(1, C, dtype=torch.long)) == [ids_a]  # type: ignore[list-item]
    assert row.state == grammar.done and seq.stats["constrained_canvases"] == 1
    # a step whose best path is thought only breaks every hold: the next document starts unheld
    t, _ = logits_for("so 12 eggs and 13 more eggs make 25 eggs so far and")
    row = checks.rows[0] = RowGrammar(grammar, grammar.start, torch.zeros(C, V, dtype=torch.bool))
    checks.slots.reset([0])  # a new canvas on the slot
    req.max_tokens = 3 * C  # room for the document in a later canvas: a thought-only path is valid
    steps = []
    for x in (a, t, a):
        x = x.clone()
        checks.mask([seq], x)  # type: ignore[list-item]
        steps.append([c for c in range(C) if (x[0, c] == NEG).sum() == V - 1])
    assert steps[2] == [], "a document compared with the path before a thought-only step"


def test_the_document_is_opened_where_the_models_argmax_holds_its_brace(texts, testbed):
    """constraint_open_hold: a thinking row whose model opens the document with a brace but misspells
    what follows has a best valid path that is all thought (the thought takes the slip; the brace is
    the one token it cannot). Once the brace has held its position for `open_hold` steps it is pinned
    there (one-hot), and from the next step's start the path begins the document at it; a brace that
    moves is not pinned, and without the rule the path stays thought."""
    open_hold_scenario(texts, testbed, kernels=False)


def open_hold_scenario(texts, testbed, kernels: bool, device: str = "cpu") -> None:
    """The open rule's test, its masks made in torch or through `kernels.constrain` (`kernels`; tests/
    kernels runs it interpreted on the CPU, compiled on `device` "cuda")."""
    from collections import Counter
    from types import SimpleNamespace

    from canvasq.decoders.constrained import RowGrammar
    from canvasq.decoders.structured import cached_grammar

    V, tok = len(texts.texts), Tokenizer.from_file(TOKENIZER)

    def logits_for(text: str) -> tuple[torch.Tensor, list[int]]:  # a whole canvas of text: no EOS in it
        ids = tok.encode(text).ids[:C]
        out = torch.zeros(1, C, V)
        out[0, torch.arange(C), torch.tensor(ids)] = 8.0
        return out.to(device), ids

    slip, ids = logits_for('so 12 eggs\n{anwser":12,"chnage":"lst","anwser":12,"chnage":"lst"')
    moved, moved_ids = logits_for('so 12 eggs.\n{anwser":12,"chnage":"lst","anwser":12,"chnage":"lst"')
    brace = next(c for c, t in enumerate(ids) if "{" in texts.texts[t])
    assert "{" in texts.texts[moved_ids[brace + 1]]  # the same slip, its brace one position on
    grammar = cached_grammar(ANSWER, texts, True)

    def run(steps, open_hold):
        checks = CanvasConstraints(testbed, C, V, torch.device(device), open_hold=open_hold)
        checks.kernels = kernels
        plan = ("any", 0, 3 * C)  # a table key: the kernel reads the row's plan from the table
        banned = torch.zeros(C, V, dtype=torch.bool, device=device)
        checks.rows[0] = RowGrammar(grammar, grammar.start, banned, plan=plan)
        req = SimpleNamespace(think=True, max_tokens=3 * C)  # room for the document in later canvases
        seq = SimpleNamespace(row=0, slot=0, req=req, canvases=[SimpleNamespace(index=0)], stats=Counter())
        out = []
        for x in steps:
            pins = _pinned(checks, seq, x)
            path, end = checks.best_of(seq)  # type: ignore[arg-type]
            out.append((pins, path[brace] == ids[brace] and end != grammar.start))
        return out

    on = run([slip, slip, slip], 1)
    assert on[0] == ([], False)  # the path is all thought; the brace has not held yet
    assert on[1] == ([brace], False)  # held one step: pinned for the sampler, the path read before it
    assert on[2] == ([brace], True)  # pinned from the step's start: the path opens the document there
    assert run([slip, slip, slip], None)[2] == ([], False)  # off: the thought keeps the slip
    assert [pins for pins, _ in run([slip, moved, slip], 1)] == [[], [], []]  # a moving brace is not pinned


@pytest.mark.parametrize(
    "text",
    [
        '{"answer":3,"totals":[1,2]}',
        '{"answer":"x","totals":[1,"a"]}',  # two errors: the best-matching one is reported
        '{"answer":3}',
        '{"answer":3,"totals":[],"x":1}',
        "[1]",
        '{"a":',
    ],
)
def test_output_problem_says_what_jsonschema_validate_says(text):
    """The output check reuses one checked validator per schema; its verdict and message are
    `jsonschema.validate`'s, and a schema that is itself invalid still raises on a JSON document."""
    from canvasq.decoders.structured import output_problem

    schema = {
        "type": "object",
        "properties": {
            "answer": {"type": "integer"},
            "totals": {"type": "array", "items": {"type": "integer"}},
        },
        "required": ["answer", "totals"],
        "additionalProperties": False,
    }
    try:
        jsonschema.validate(json.loads(text), schema)
        want = None
    except json.JSONDecodeError as exc:
        want = f"not JSON: {exc}"
    except jsonschema.ValidationError as exc:
        want = f"does not match the schema: {exc.message}"
    assert output_problem(text, schema) == want
    if text.startswith("{") and text.endswith("}"):
        with pytest.raises(jsonschema.SchemaError):
            output_problem(text, {"type": "no-such-type"})


def test_masks_as_one_select_equal_the_row_by_row_fill(texts, testbed, monkeypatch):
    """The constrained rows' masks applied as one select over the group (small masks) and row by row
    (large ones) ban the same logits, only the constrained rows' and only their banned tokens."""
    from canvasq.decoders import constrained
    from canvasq.decoders.constrained import RowGrammar
    from canvasq.decoders.structured import cached_grammar

    V = len(texts.texts)
    grammar = cached_grammar(ANSWER, texts, False)
    checks = CanvasConstraints(testbed, C, V, torch.device("cpu"))
    gen = torch.Generator().manual_seed(4)
    rows = [RowGrammar(grammar, grammar.start, torch.rand(C, V, generator=gen) < p) for p in (0.3, 0.7)]
    at = [(2, None, rows[0]), (0, None, rows[1])]  # rows of the group, out of order; row 1 free
    logits = torch.randn(3, C, V, generator=gen)
    got = {}
    for limit in (1 << 26, 0):
        monkeypatch.setattr(constrained, "BAN_STACK_ELEMENTS", limit)
        x = logits.clone()
        checks._ban(at, x, torch.tensor([2, 0]))  # type: ignore[arg-type]
        got[limit] = x
    assert torch.equal(got[0], got[1 << 26])
    want = logits.clone()
    want[2][rows[0].banned] = NEG
    want[0][rows[1].banned] = NEG
    assert torch.equal(got[0], want)


def _random_doc(rng, schema: dict | None, depth: int = 0):
    """A JSON value for `schema`: often a valid one, sometimes any value (random type, length or key)."""
    if schema is None or rng.random() < 0.15:
        kind = rng.choice(
            ["int", "float", "str", "bool", "null", "list", "dict"] if depth < 2 else ["int", "str"]
        )
        return {
            "int": lambda: rng.randint(-3, 3),
            "float": lambda: rng.choice([1.0, 2.5, -0.0]),
            "str": lambda: "ab\u00e9\U0001f600"[: rng.randint(0, 4)],
            "bool": lambda: rng.random() < 0.5,
            "null": lambda: None,
            "list": lambda: [_random_doc(rng, None, depth + 1) for _ in range(rng.randint(0, 3))],
            "dict": lambda: {
                k: _random_doc(rng, None, depth + 1) for k in rng.sample("abx", rng.randint(0, 2))
            },
        }[kind]()
    if "enum" in schema or "const" in schema:
        return rng.choice(schema.get("enum", [schema.get("const")]) + [True, 1, 1.0, "a"])
    kind = schema["type"] if isinstance(schema["type"], str) else rng.choice(schema["type"])
    if kind == "object":
        props = schema.get("properties", {})
        keys = [k for k in props if k in schema.get("required", []) or rng.random() < 0.7]
        return {k: _random_doc(rng, props[k], depth + 1) for k in keys}
    if kind == "array":
        return [_random_doc(rng, schema["items"], depth + 1) for _ in range(rng.randint(0, 4))]
    return (
        _random_doc(rng, None, 9)
        if kind == "string" and rng.random() < 0.5
        else {
            "string": lambda: "xy\u00e9"[: rng.randint(0, 3)],
            "integer": lambda: rng.choice([0, 7, -2, 3.0]),
            "number": lambda: rng.choice([0, 1.5, -2]),
            "boolean": lambda: rng.random() < 0.5,
            "null": lambda: None,
        }[kind]()
    )


def test_the_fast_output_check_agrees_with_jsonschema_on_every_supported_keyword():
    """`schema_check` passes documents by fastjsonschema's compiled check and refuses only what
    jsonschema refuses: on random documents (valid and not) under a schema of each supported keyword,
    the fast check's verdict is jsonschema's."""
    import random

    import fastjsonschema

    from canvasq.core.response_format import schema_problems
    from canvasq.decoders.schema_text import JSON_OBJECT
    from canvasq.decoders.structured import schema_check

    schemas = [
        JSON_OBJECT,
        {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 2}},
         "required": ["a"], "additionalProperties": False},
        {"type": "array", "items": {"type": "number"}, "minItems": 1, "maxItems": 3},
        {"type": "array", "items": {"type": ["integer", "null"]}},
        {"type": "string", "minLength": 1, "maxLength": 3},
        {"enum": ["gained", "lost", 1, None]},
        {"const": 1},
        {"type": "boolean"},
        {"type": "object", "properties": {"x": {"type": "array", "items": {"enum": [0, 2.5]}, "maxItems": 2}},
         "required": ["x"], "additionalProperties": False},
    ]  # fmt: skip
    rng = random.Random(7)
    verdicts = []
    for schema in schemas:
        assert schema is JSON_OBJECT or schema_problems(schema) == [], schema  # json_object's own
        fast = fastjsonschema.compile(schema)
        reference = jsonschema.validators.validator_for(schema)(schema)
        check = schema_check(json.dumps(schema, sort_keys=True))
        for _ in range(150):
            doc = _random_doc(rng, schema)
            try:
                fast(doc)
                passed = True
            except fastjsonschema.JsonSchemaException:
                passed = False
            valid = reference.is_valid(doc)
            assert passed == valid, (schema, doc)
            assert (check(json.dumps(doc)) is None) == valid, (schema, doc)
            verdicts.append(valid)
    assert 0.2 < sum(verdicts) / len(verdicts) < 0.8  # both verdicts met often


def test_the_masks_host_time_reaches_the_row_once_it_is_accounted(texts, testbed):
    """`mask` keeps its host time per slot (no stats write a row a step); `account` (the decoder's
    `_result`) moves a finished row's into its `stats["constraint_host_us"]` once, and its slot starts
    the next row from nothing."""
    from collections import Counter
    from types import SimpleNamespace

    from canvasq.decoders.constrained import RowGrammar
    from canvasq.decoders.structured import cached_grammar

    a, _ = _one_hot(texts, 'so 12 eggs\n{"answer":12}')
    grammar = cached_grammar(ANSWER, texts, True)
    checks = CanvasConstraints(testbed, C, len(texts.texts), torch.device("cpu"), settle=2)
    seqs = []
    for slot in (0, 3):
        checks.rows[slot] = RowGrammar(
            grammar, grammar.start, torch.zeros(C, len(texts.texts), dtype=torch.bool)
        )
        req = SimpleNamespace(think=True, max_tokens=C)
        seqs.append(
            SimpleNamespace(
                row=slot, slot=slot, req=req, stats=Counter(), canvases=[SimpleNamespace(index=0)]
            )
        )
    for _ in range(3):
        checks.mask(seqs, a.expand(2, -1, -1).clone())  # type: ignore[arg-type]
    assert all("constraint_host_us" not in s.stats for s in seqs)
    checks.account(seqs[1])  # type: ignore[arg-type]
    spent = seqs[1].stats["constraint_host_us"]
    assert spent > 0 and "constraint_host_us" not in seqs[0].stats
    checks.account(seqs[1])  # type: ignore[arg-type]
    assert seqs[1].stats["constraint_host_us"] == spent  # moved once, not again
    checks.account(seqs[0])  # type: ignore[arg-type]
    assert seqs[0].stats["constraint_host_us"] > 0


def test_a_vocabularys_texts_are_hashed_once_and_compare_by_value():
    """`cached_grammar` keys its cache by the vocabulary's texts at every row's first canvas: their hash
    is computed once, not by walking every text again (262,144 of them at the real vocabulary), and two
    vocabularies of the same texts are one key."""
    from canvasq.decoders.structured import TokenTexts

    walks = []

    class Text(str):
        def __hash__(self) -> int:
            walks.append(self)
            return super().__hash__()

    words = tuple(Text(w) for w in ("a", "b", "{", "}"))
    texts = TokenTexts((*words, None, None), 4, 5)
    after = len(walks)
    assert after == len(words)  # the one walk, when made
    assert hash(texts) == hash(texts) == hash(TokenTexts(texts.texts, 4, 5))
    assert len(walks) == 2 * after  # the second vocabulary's own walk; none from hashing
    assert texts == TokenTexts(texts.texts, 4, 5) and texts != TokenTexts(texts.texts, 4, 4)
    assert {texts: 1}[TokenTexts(texts.texts, 4, 5)] == 1
