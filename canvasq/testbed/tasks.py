"""Two verifiable task families for the testbed, shaped like the seeds' benchmarks.

- `arith` (GSM8K-shaped): a short word problem with several arithmetic steps; the answer shows the
  worked steps and ends with `#### <integer>`; the verifier compares that integer.
- `code` (HumanEval-shaped): a Python signature plus docstring with an example; the model writes
  the body; the sandboxed child computes the function on the hidden inputs and the trusted parent
  compares the values with the hidden expected ones (`verify`).
- `long` (arith's long variant): one `arith` story carried on for 8-10 operations, so the worked
  answer spans at least 6 canvases of 32 tokens (the testbed's; `ANSWER_CANVASES` sizes max_tokens).
  Same verifier as arith. The testbed was trained on 2-3 operations only: how far decoders carry a
  long worked form is the point of the variant, not a score the model was fit to.

Both draw from spaces of well over 10^9 distinct problems (names × items × numbers × templates ×
docstring examples) and are deterministic per (split, seed).

Splits by purpose (`generate(..., split=)`): `train` (train.py, repair.py, the tokenizer), `dev`
(tuning: `canvasq calibrate`) and `eval` (everything that reports accuracy). A stable hash of the
prompt text puts every possible problem in exactly one split (`split_of`), and each split draws from
its own stream, keeping only its own problems: train, dev and eval are disjoint by construction,
whatever the seeds. The committed checkpoint was trained before the splits existed, on the legacy
streams of `ledger.LEGACY_TRAINING`; dev and eval also skip every prompt of those (`ledger`'s Bloom
filter), so no seed of them repeats a problem the weights were trained on.
"""

from __future__ import annotations

import ast
import hashlib
import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field

TASKS = ("arith", "code")  # the two trained families
VARIANTS = ("long",)  # evaluated like a family, never trained on
# Service task names → testbed families.
TASK_ALIASES = {"math": "arith", "arith": "arith", "code": "code", "long": "long"}
# Canvases of the model's length an eval gives an answer (max_tokens = this × canvas length).
ANSWER_CANVASES = {"arith": 5, "code": 5, "long": 12}


@dataclass(frozen=True)
class Problem:
    uid: str
    task: str
    prompt: str
    answer: str  # a reference completion (what the model is trained to write)
    target: int | None = None  # arith: the final integer
    tests: list[str] = field(default_factory=list)  # code: hidden asserts
    entry: str | None = None  # code: the function name


# --------------------------------------------------------------------------------------- arith

NAMES = [
    "Ann",
    "Ben",
    "Cara",
    "Dev",
    "Eli",
    "Fay",
    "Gus",
    "Hana",
    "Ivan",
    "Jill",
    "Kofi",
    "Lena",
    "Max",
    "Nora",
    "Omar",
    "Pia",
    "Quinn",
    "Rosa",
    "Sam",
    "Tara",
    "Uma",
    "Vic",
    "Wes",
    "Xena",
    "Yuri",
    "Zoe",
    "Mia",
    "Leo",
    "Ava",
    "Raj",
    "Ines",
    "Tom",
    "Lia",
    "Noah",
    "Ida",
    "Kai",
    "Ola",
    "Ravi",
    "Sia",
    "Ted",
]
ITEMS = [
    ("apples", "bags"),
    ("pencils", "packs"),
    ("stickers", "sheets"),
    ("marbles", "jars"),
    ("cookies", "boxes"),
    ("cards", "decks"),
    ("stamps", "books"),
    ("shells", "buckets"),
    ("beads", "strings"),
    ("coins", "rolls"),
    ("eggs", "cartons"),
    ("books", "crates"),
    ("toys", "bins"),
    ("pens", "cases"),
    ("balls", "nets"),
    ("candles", "sets"),
    ("cups", "trays"),
    ("rocks", "sacks"),
    ("nails", "tins"),
    ("seeds", "packets"),
    ("bricks", "piles"),
    ("buttons", "bags"),
    ("ribbons", "rolls"),
    ("plums", "baskets"),
    ("blocks", "tubs"),
]


def _pronoun(rng: random.Random) -> str:
    return rng.choice(["She", "He"])


def _add_work(a: int, b: int) -> str:
    """Column addition written out digit by digit (a + b < 100): "47 + 38: 7 + 8 = 15, 4 + 3 + 1 = 8,
    so 85"."""
    ones = a % 10 + b % 10
    carry = ones // 10
    tens = a // 10 + b // 10 + carry
    tens_expr = f"{a // 10} + {b // 10}" + (" + 1" if carry else "")
    if b < 10:
        tens_expr = f"{a // 10}" + (" + 1" if carry else "")
    if a < 10 and b < 10:
        return f"{a} + {b} = {a + b}"
    return f"{a} + {b}: {a % 10} + {b % 10} = {ones}, {tens_expr} = {tens}, so {a + b}"


def _sub_work(a: int, b: int) -> str:
    """Column subtraction digit by digit (0 < b < a < 100): "71 - 15: 11 - 5 = 6, 7 - 1 - 1 = 5,
    so 56"."""
    borrow = a % 10 < b % 10
    top = a % 10 + (10 if borrow else 0)
    ones = top - b % 10
    tens_expr = f"{a // 10}" + (f" - {b // 10}" if b >= 10 else "") + (" - 1" if borrow else "")
    tens = a // 10 - b // 10 - (1 if borrow else 0)
    if a < 10:
        return f"{a} - {b} = {a - b}"
    return f"{a} - {b}: {top} - {b % 10} = {ones}, {tens_expr} = {tens}, so {a - b}"


def make_arith(rng: random.Random, uid: str, ops: tuple[int, int] = (2, 3), task: str = "arith") -> Problem:
    """2–3 operations (`ops`) on numbers below 100: single-digit products, two-digit sums and
    differences whose worked steps go column by column (a tiny model can learn digit facts;
    whole-number carries in one token it cannot)."""
    name, (item, box) = rng.choice(NAMES), rng.choice(ITEMS)
    he = _pronoun(rng)
    total = rng.randint(10, 60)
    story = [f"{name} has {total} {item}."]
    work = [f"{name} starts with {total} {item}."]
    used_buy = False
    for _ in range(rng.randint(*ops)):
        room = 99 - total
        kinds = [
            k
            for k, ok in (
                ("buy", not used_buy and room >= 4),
                ("find", room >= 2),
                ("give", total > 3),
                ("lose", total > 3),
            )
            if ok
        ]
        kind = rng.choice(kinds)
        if kind == "buy":
            used_buy = True
            b = rng.randint(2, 9)
            c = rng.randint(2, max(2, min(9, room // b)))
            prod = b * c
            story.append(f"{he} buys {b} {box} with {c} {item} each.")
            work.append(f"The {box} hold {b} * {c} = {prod} {item}.")
            work.append(f"{_add_work(total, prod)} {item}.")
            total += prod
        elif kind == "find":
            e = rng.randint(2, min(40, room))
            story.append(f"{he} finds {e} more {item}.")
            work.append(f"{_add_work(total, e)} {item}.")
            total += e
        else:
            d = rng.randint(2, min(40, total - 1))
            verb = "gives away" if kind == "give" else "loses"
            story.append(f"{he} {verb} {d} {item}.")
            work.append(f"{_sub_work(total, d)} {item}.")
            total -= d
    story.append(f"How many {item} does {name} have now?")
    answer = " ".join(work) + f"\n#### {total}"
    return Problem(uid=uid, task=task, prompt=" ".join(story), answer=answer, target=total)


def make_long(rng: random.Random, uid: str) -> Problem:
    """arith carried on for 8-10 operations: a worked answer of 6+ testbed canvases. Stories of
    mostly one-digit steps write short answers; they are drawn again (the testbed tokenizer writes
    at most 1.92 characters per token here, so 370 characters hold ≥ 192 tokens)."""
    while True:
        p = make_arith(rng, uid, ops=(8, 10), task="long")
        if len(p.answer) >= 370:
            return p


_FINAL = re.compile(r"####\s*(-?\d+)")


def arith_answer(text: str) -> int | None:
    m = _FINAL.search(text)
    return int(m.group(1)) if m else None


# ---------------------------------------------------------------------------------------- code

VERBS = ["sum", "count", "mult", "scan", "pick", "tally", "fold", "gather", "total", "measure"]
NOUNS = ["big", "small", "even", "odd", "hits", "vals", "nums", "items", "marks", "points", "steps"]
ARGS = ["xs", "nums", "values", "items", "data", "arr", "seq", "lst"]
PREDICATES = [  # (docstring phrase, python condition on x, needs k)
    ("greater than {k}", "x > {k}"),
    ("less than {k}", "x < {k}"),
    ("at least {k}", "x >= {k}"),
    ("at most {k}", "x <= {k}"),
    ("equal to {k}", "x == {k}"),
    ("not equal to {k}", "x != {k}"),
    ("divisible by {k}", "x % {k} == 0"),
]
AGGREGATES = [  # (docstring phrase, init, update)
    ("sum", "0", "{acc} += x"),
    ("count", "0", "{acc} += 1"),
    ("product", "1", "{acc} *= x"),
]
TRANSFORMS = [("multiplied by {k}", "x * {k}"), ("plus {k}", "x + {k}"), ("minus {k}", "x - {k}")]


def _code_name(rng: random.Random) -> str:
    return f"{rng.choice(VERBS)}_{rng.choice(NOUNS)}_{rng.randint(1, 99)}"


def _sample_list(rng: random.Random) -> list[int]:
    return [rng.randint(0, 12) for _ in range(rng.randint(3, 6))]


def _filtered_aggregate(rng: random.Random, name: str, arg: str):
    phrase, init, update = rng.choice(AGGREGATES)
    pred_doc, pred_py = rng.choice(PREDICATES)
    k = rng.randint(2, 9) if "%" in pred_py else rng.randint(0, 12)
    acc = rng.choice(["total", "acc", "result", "out"])
    doc = f"Return the {phrase} of the numbers in {arg} that are {pred_doc.format(k=k)}."
    body = (
        f"    {acc} = {init}\n"
        f"    for x in {arg}:\n"
        f"        if {pred_py.format(k=k)}:\n"
        f"            {update.format(acc=acc)}\n"
        f"    return {acc}\n"
    )
    return doc, body


def _filtered_map(rng: random.Random, name: str, arg: str):
    t_doc, t_py = rng.choice(TRANSFORMS)
    pred_doc, pred_py = rng.choice(PREDICATES)
    k1 = rng.randint(2, 9)
    k2 = rng.randint(2, 9) if "%" in pred_py else rng.randint(0, 12)
    doc = (
        f"Return a list of the numbers in {arg} that are {pred_doc.format(k=k2)}, each {t_doc.format(k=k1)}."
    )
    body = (
        "    out = []\n"
        f"    for x in {arg}:\n"
        f"        if {pred_py.format(k=k2)}:\n"
        f"            out.append({t_py.format(k=k1)})\n"
        "    return out\n"
    )
    return doc, body


COMBINE = [("plus", "+"), ("minus", "-"), ("times", "*")]


def _two_aggregates(rng: random.Random, name: str, arg: str):
    """Two filtered aggregates in one loop, combined: the longest family (two canvases)."""
    parts = []
    for acc in ("a", "b"):
        phrase, init, update = rng.choice(AGGREGATES)
        pred_doc, pred_py = rng.choice(PREDICATES)
        k = rng.randint(2, 9) if "%" in pred_py else rng.randint(0, 12)
        parts.append((acc, phrase, init, update, pred_doc.format(k=k), pred_py.format(k=k)))
    (a, pa, ia, ua, da, ca), (b, pb, ib, ub, db, cb) = parts
    word, op = rng.choice(COMBINE)
    doc = (
        f"Return the {pa} of the numbers in {arg} that are {da}, {word} "
        f"the {pb} of the numbers in {arg} that are {db}."
    )
    body = (
        f"    {a} = {ia}\n"
        f"    {b} = {ib}\n"
        f"    for x in {arg}:\n"
        f"        if {ca}:\n"
        f"            {ua.format(acc=a)}\n"
        f"        if {cb}:\n"
        f"            {ub.format(acc=b)}\n"
        f"    return {a} {op} {b}\n"
    )
    return doc, body


def make_code(rng: random.Random, uid: str) -> Problem:
    name, arg = _code_name(rng), rng.choice(ARGS)
    doc, body = rng.choice([_filtered_aggregate, _filtered_map, _two_aggregates])(rng, name, arg)
    func = f"def {name}({arg}):\n" + body
    namespace: dict = {}
    exec(func, namespace)  # noqa: S102 - our own reference implementation, never model output
    ref = namespace[name]
    example = _sample_list(rng)
    prompt = f'def {name}({arg}):\n    """{doc}\n    >>> {name}({example})\n    {ref(example)!r}\n    """\n'
    # Hidden tests: keep drawing until the expected outputs differ, so a constant body fails.
    cases: list[list[int]] = []
    for _ in range(60):
        cases.append(_sample_list(rng))
        outs = {repr(ref(xs)) for xs in cases[-6:]}
        if len(cases) >= 6 and len(outs) >= 3:
            break
    tests = [f"assert {name}({xs!r}) == {ref(xs)!r}" for xs in cases[-6:]]
    return Problem(uid=uid, task="code", prompt=prompt, answer=body, tests=tests, entry=name)


# ------------------------------------------------------------------------------------- public

_MAKERS = {"arith": make_arith, "code": make_code, "long": make_long}


SPLITS = ("train", "dev", "eval")
# A prompt's bucket of 8 (`split_of`): 1/8 eval, 1/8 dev, the rest train. Eval and dev streams keep
# one candidate in 8 (a code problem costs ~80 µs to draw, so 200 eval problems take ~0.13 s).
_SPLIT_OF_BUCKET = ("eval", "dev", "train", "train", "train", "train", "train", "train")


def split_of(prompt: str) -> str:
    """The split a prompt belongs to, from a stable hash of its text (blake2b: Python's own `hash`
    of a str changes per process), so the partition is the same on every machine and in every run."""
    digest = hashlib.blake2b(prompt.encode(), digest_size=8, person=b"canvasq-split").digest()
    return _SPLIT_OF_BUCKET[int.from_bytes(digest, "little") % len(_SPLIT_OF_BUCKET)]


def generate(task: str, n: int, seed: int, split: str = "eval") -> list[Problem]:
    """`n` problems of one family from one split, deterministic per (task, split, seed); uids
    `<task>-<split>-<seed>-<i>`. The split's stream keeps drawing and keeps only problems of its own
    bucket (`split_of`); dev and eval also skip the legacy training prompts (`ledger`)."""
    task = TASK_ALIASES.get(task, task)
    if task not in _MAKERS:
        raise ValueError(f"unknown task {task!r}; known: {', '.join(TASKS + VARIANTS)}")
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; known: {', '.join(SPLITS)}")
    held_out: Callable[[str], bool] | None = None
    if split != "train":
        from canvasq.testbed.ledger import in_legacy_training as held_out
    make, rng = _MAKERS[task], random.Random(f"{task}:{split}:{seed}")
    out: list[Problem] = []
    while len(out) < n:
        p = make(rng, f"{task}-{split}-{seed}-{len(out)}")
        if split_of(p.prompt) == split and not (held_out and held_out(p.prompt)):
            out.append(p)
    return out


def legacy_generate(task: str, n: int, seed: int) -> list[Problem]:
    """What `generate` drew before the splits (one unpartitioned stream per (task, seed)): the data the
    committed checkpoint was trained on (`ledger.LEGACY_TRAINING`). Kept only to exclude it from dev
    and eval; never draw new data from it."""
    rng = random.Random(f"{task}:{seed}")
    return [_MAKERS[task](rng, f"{task}-{seed}-{i}") for i in range(n)]


def verify(problem: Problem, completion: str, timeout_s: float = 5.0) -> bool:
    """True when the completion answers the problem: the final integer for arith; for code, the
    function's value on every hidden input equal to the expected one.

    The sandboxed child only computes values: it gets the prompt + completion and the inputs (never
    the expected values), and writes `repr` of each result to its data channel. Here, in the trusted
    parent, those are parsed as plain literals and compared. Exit code, printed text and the `__eq__`
    of the child's objects decide nothing. Raises `sandbox.SandboxUnavailable` where code cannot be
    run safely."""
    if problem.task in ("arith", "long"):
        return arith_answer(completion) == problem.target
    from canvasq.testbed.sandbox import run_python

    cases = code_cases(problem)
    assert problem.entry is not None  # code_cases found calls to it
    r = run_python(
        _harness(problem.prompt + completion, problem.entry, [a for a, _ in cases]), timeout_s=timeout_s
    )
    values = _parse_values(r.result, len(cases)) if not r.truncated else None
    if values is None:
        return False
    try:
        return all(v is not _MISSING and v == expected for v, (_, expected) in zip(values, cases))
    except Exception:  # noqa: BLE001 - plain literals compare without raising; be safe anyway
        return False


def code_cases(problem: Problem) -> list[tuple[str, object]]:
    """The hidden asserts `assert entry(<args>) == <expected>` as (argument tuple source, expected
    value) pairs, parsed without running anything."""
    cases = []
    for test in problem.tests:
        node = ast.parse(test, mode="exec").body[0]
        cmp = node.test if isinstance(node, ast.Assert) else None
        call = cmp.left if isinstance(cmp, ast.Compare) else None
        if not (
            isinstance(cmp, ast.Compare)
            and isinstance(call, ast.Call)
            and isinstance(call.func, ast.Name)
            and call.func.id == problem.entry
            and not call.keywords
            and len(cmp.ops) == 1
            and isinstance(cmp.ops[0], ast.Eq)
        ):
            raise ValueError(f"{problem.uid}: unsupported hidden test {test!r}")
        args = tuple(ast.literal_eval(a) for a in call.args)
        cases.append((repr(args), ast.literal_eval(cmp.comparators[0])))
    return cases


# The child's whole program. It sees the candidate source, the entry name and the inputs only.
_HARNESS = """\
import ast as _ast, json as _json
_ns = {{"__name__": "__main__"}}
exec(compile({source!r}, "<candidate>", "exec"), _ns)
_fn, _out = _ns[{entry!r}], []
for _args in {inputs!r}:
    try:
        _out.append(["value", repr(_fn(*_ast.literal_eval(_args)))])
    except BaseException as _exc:  # SystemExit too: that input has no value
        _out.append(["raised", type(_exc).__name__])
with open(3, "w", closefd=False) as _channel:
    _channel.write(_json.dumps(_out))
"""

_MISSING = object()
_MAX_REPR = 100_000


def _harness(source: str, entry: str, inputs: list[str]) -> str:
    return _HARNESS.format(source=source, entry=entry, inputs=inputs)


def _parse_values(raw: bytes, n: int) -> list | None:
    """The child's `[["value", repr], ...]` as plain Python literals (`_MISSING` where a call raised
    or the repr is not a literal); None when the channel does not hold exactly n entries."""
    try:
        items = json.loads(raw.decode("utf-8"))
    except Exception:  # noqa: BLE001 - bad UTF-8, bad JSON, nesting past the recursion limit
        return None
    if not isinstance(items, list) or len(items) != n:
        return None
    values = []
    for item in items:
        value = _MISSING
        if (
            isinstance(item, list)
            and len(item) == 2
            and item[0] == "value"
            and isinstance(item[1], str)
            and len(item[1]) <= _MAX_REPR
        ):
            try:
                value = ast.literal_eval(item[1])
            except Exception:  # noqa: BLE001 - not a literal (an object's default repr, ...)
                value = _MISSING
        values.append(value)
    return values
