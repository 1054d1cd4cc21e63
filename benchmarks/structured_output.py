"""Issue 36, item 3: structured output on the testbed. The same eval arith prompts decoded by `official`
free (the reference: its final `#### N` answer) and under JSON schemas, each asked of the answer:

    answer         {"answer": integer}                               correct: the integer is the target
    change         {"change": "gained" | "lost" | "same"}             correct: the target against the start
    totals         {"totals": [integer, ...] (at most 6)}             correct: its last element is the target
    worked         {"reasoning": string, "answer": integer}          correct: the integer is the target
    worked_change  {"reasoning": string, "change": "gained" | ...}   correct: as change
    answer_change  {"answer": integer, "change": "gained" | ...}     correct: the integer is the target
    answer_totals  {"answer": integer, "totals": [integer, ...]}     correct: the integer is the target

The last two ask the arith answer first and then a field of another shape (an enum, an array of at
most 6 integers): the accuracy is the answer's; each arm also reports its second field's
(`second_correct`: the change against the start, the totals' last element against the target).

Per arm: rows, rows done, done rows that parse and validate (jsonschema), accuracy over all rows
(errored or invalid rows count as wrong), forwards per request, wall seconds, committed tokens per
second, the constraint's host time; the reference's accuracy is given for each schema's question.
`--think` gives each constrained line `reasoning_effort` medium: the row writes its working free
before its document (the thought is the row's `reasoning`; its answer is read from the document).
`--prompt-only` adds, per schema, the same lines decoded with nothing holding them to the schema:
the constraint's overhead against it is the constraint's own, apart from the longer text a document
is. `--adapter DIR` merges a LoRA (`python -m canvasq.testbed.json_adapter`) into the model first: both
the free and the constrained arms then run the same weights. `--split dev` draws the prompts a
setting is tuned on (claims are made on `eval`); `--settle-positions 1 -1` runs each schema once per
value of `OfficialConfig.constraint_settle_positions` (-1: off) in the same process, the arms'
order alternating by seed; `--settle 1 2` and `--max-steps 6 -1` do the same for `constraint_settle`
and `constraint_max_steps`, `--open-hold 1 -1` for `constraint_open_hold` (an arm per combination). The report is rewritten after every arm.

Every row is a batch line validated as the service validates it (`core.schemas.parse_line`): a
constrained row's prompt is the problem with its schema shown before it (`CANVASQ_SCHEMA_IN_PROMPT`,
`decoders.schema_text.shown_prompt`; `--no-schema-in-prompt` turns it off), the free row's the problem.

    nice -n 10 python3 benchmarks/structured_output.py --n 48 --seeds 1 --batch 16 --out report.json
    nice -n 10 python3 benchmarks/structured_output.py --adapter models/testbed/json_adapter \
        --schemas worked worked_change answer --n 200 --seeds 61 62 63 --threads 1 --out report.json
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import json
import re
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks.phases

from benchmarks.phases import PhaseClock
from canvasq.core.schemas import Limits, parse_line
from canvasq.core.settings import Settings
from canvasq.decoders import DecodeBatch, DecodeRequest, make_decoder, run_batch
from canvasq.decoders.configs import OfficialConfig
from canvasq.decoders.grammar_device import DeviceGrammar
from canvasq.decoders.slots import drain
from canvasq.decoders.structured import output_problem, split_thought
from canvasq.model.loading import freeze_heap, load_bundle
from canvasq.provenance import git_commit
from canvasq.testbed import tasks
from canvasq.testbed.json_adapter import FORM_SCHEMAS

# the JSON adapter's forms' schemas (one source: its training prompts show them); the think forms
# answer the same schemas (`--think`)
SCHEMAS = {k: v for k, v in FORM_SCHEMAS.items() if not k.startswith("think")}
SECOND = {"answer_change": "change", "answer_totals": "totals"}  # a composite schema's second field
# max_tokens of a constrained row: one canvas for a bare value, six for a document with the working
# (a free answer is at most ~140 tokens; the keys and quotes add ~20)
MAX_CANVASES = {
    "answer": 1,
    "change": 1,
    "totals": 1,
    "worked": 6,
    "worked_change": 6,
    "answer_change": 1,
    "answer_totals": 2,
}
# the question a schema asks, where it differs from its name
QUESTION = {
    "worked": "answer",
    "worked_change": "change",
    "answer_change": "answer",
    "answer_totals": "answer",
}
_START = re.compile(r"has (\d+)")


def change_of(start: int, end: int | None) -> str | None:
    if end is None:
        return None
    return "gained" if end > start else "lost" if end < start else "same"


def start_of(p) -> int:
    """What the problem's person starts with (every arith prompt says "has N")."""
    m = _START.search(p.prompt)
    if m is None:
        raise ValueError(f"{p.uid}: no starting amount in the prompt")
    return int(m.group(1))


def truth(schema: str, p) -> object:
    schema = QUESTION.get(schema, schema)
    start = start_of(p)
    return p.target if schema != "change" else change_of(start, p.target)


def asked(schema: str, p, doc: dict | None, free_answer: int | None = None) -> object:
    """What the row says to the schema's question: from its document, or (reference) its final answer."""
    start = start_of(p)
    field = QUESTION.get(schema, schema)
    if doc is None:
        return free_answer if field != "change" else change_of(start, free_answer)
    if field in ("answer", "change"):
        return doc[field]
    return doc["totals"][-1] if doc["totals"] else None


def jobs(problems, schema: dict | None, max_tokens: int, limits: Limits, think: bool = False) -> list:
    """The problems as batch lines (`response_format` json_schema, strict, where `schema` is given;
    `think`: with `reasoning_effort` medium) through the service's validation: each `Job.prompt` is
    the text its row's model is given."""
    out = []
    for i, p in enumerate(problems, 1):
        line: dict = {"custom_id": p.uid, "prompt": p.prompt, "max_tokens": max_tokens, "decoder": "official"}
        if schema is not None:
            spec = {"name": "answer", "schema": schema, "strict": True}
            line["response_format"] = {"type": "json_schema", "json_schema": spec}
            if think:
                line["reasoning_effort"] = "medium"
        job, errors = parse_line(line, i, limits)
        if job is None:
            raise ValueError(f"line {i} ({p.uid}): {'; '.join(errors)}")
        out.append(job)
    return out


def decode(
    bundle,
    problems,
    schema,
    max_tokens: int,
    batch: int,
    seed: int,
    limits: Limits,
    overrides=None,
    think=False,
    unconstrained=False,
    stream=False,
    occupancy: list | None = None,
    phases: dict | None = None,
):
    """Results and wall seconds, in batches of `batch` (one `run_batch` each), or with `stream` as the
    worker decodes: one continuous-batching stream of `batch` slots, refilled as rows finish (a slow
    row holds its slot, not a whole batch); `unconstrained`: the constrained lines' prompts decoded
    without their `response_format` (nothing holds them to it); `occupancy`, with `stream`, receives
    (live rows, slots) per decoder step; `phases`, with `stream`, receives the host ms a step of each of
    the decoder's phases (`phases.PhaseClock`)."""
    reqs = [
        DecodeRequest(
            j.custom_id,
            bundle.encode_prompt(j.prompt, "arith"),
            max_tokens,
            "arith",
            None if unconstrained else j.response_format,
            j.think,
        )
        for j in jobs(problems, schema, max_tokens, limits, think)
    ]
    overrides = dict(overrides or {})
    with viterbi_class_min(overrides.pop(VITERBI_CLASS_MIN, None)):
        return _decode(bundle, reqs, batch, seed, overrides, stream, occupancy, phases)


def _decode(bundle, reqs, batch, seed, overrides, stream, occupancy, phases):
    t0 = time.perf_counter()
    if stream:
        dec = make_decoder("official", bundle, overrides)
        occupancy = [] if occupancy is None else occupancy
        with PhaseClock() if phases is not None else contextlib.nullcontext() as clock:
            out = drain(dec, reqs, batch, seed, occupancy)
        wall = time.perf_counter() - t0
        if clock is not None:
            phases |= clock.report(wall, len(occupancy))
        return out, wall
    out = []
    for i in range(0, len(reqs), batch):
        out += run_batch(
            bundle, DecodeBatch(reqs[i : i + batch], seed=seed), decoder="official", overrides=overrides
        )
    return out, time.perf_counter() - t0


def arm_report(name: str, results, wall: float, problems, correct: list[bool], schema: dict | None) -> dict:
    done = [r for r in results if r.error is None]
    valid = [r for r in done if schema is None or output_problem(r.text, schema) is None]
    tokens = sum(len(r.token_ids) for r in done)
    return {
        "arm": name,
        "rows": len(results),
        "done": len(done),
        "valid": len(valid),
        "errors": sorted({r.error_code or "decode_error" for r in results if r.error}),
        "correct": sum(correct),
        "accuracy": sum(correct) / len(results),
        "fwd_req": sum(r.forwards for r in results) / len(results),
        # a finite set's tail: a few rows far past the rest keep a stream's last steps nearly empty
        "fwd_quantiles": {q: _quantile([r.forwards for r in results], q) for q in (0.5, 0.9, 0.99, 1.0)},
        "wall_s": wall,
        "tok_s": tokens / wall,
        "tokens_req": tokens / max(1, len(done)),
        "constraint_host_ms_req": sum(r.stats.get("constraint_host_us", 0) for r in results)
        / 1e3
        / len(results),
        "rewritten_tokens_req": sum(r.stats.get("constrained_changed", 0) for r in results) / len(results),
    }


def constrained_arm(label: str, name: str, problems, res, wall: float) -> dict:
    """A constrained arm's report: the question's accuracy and, for a composite schema, its second field's."""
    ok, second = [], []
    for p, r in zip(problems, res):
        doc = json.loads(r.text) if r.error is None else None
        ok.append(doc is not None and asked(name, p, doc) == truth(name, p))
        if name in SECOND:
            field = SECOND[name]
            second.append(doc is not None and asked(field, p, doc) == truth(field, p))
    arm = arm_report(label, res, wall, problems, ok, SCHEMAS[name])
    if second:
        arm["second_field"], arm["second_correct"] = SECOND[name], sum(second)
    return arm


def prompt_only_arm(label: str, name: str, problems, res, wall: float) -> dict:
    """An unconstrained arm of a schema's prompts: its documents (the text from the first "{" or "[")
    checked, parsed and asked as a constrained arm's; nothing held them to the schema."""
    docs = [split_thought(r.text)[1] if r.error is None else None for r in res]
    parsed = [
        json.loads(d) if d is not None and output_problem(d, SCHEMAS[name]) is None else None for d in docs
    ]
    ok = [doc is not None and asked(name, p, doc) == truth(name, p) for p, doc in zip(problems, parsed)]
    arm = arm_report(label, res, wall, problems, ok, None)
    arm["valid"] = sum(doc is not None for doc in parsed)
    if name in SECOND:
        field = SECOND[name]
        arm["second_field"] = field
        arm["second_correct"] = sum(
            doc is not None and asked(field, p, doc) == truth(field, p) for p, doc in zip(problems, parsed)
        )
    return arm


def _off(value: int | None) -> int | None:
    """A knob's value from the command line: -1 (or None) is off."""
    return None if value is None or value < 0 else value


# the Viterbi's class floor (`kernels.viterbi.csr`'s `class_min`) of an arm's constrained rows on CUDA
VITERBI_CLASS_MIN = "viterbi_class_min"


@contextlib.contextmanager
def viterbi_class_min(value: int | None):
    """The Viterbi's layout with (source, destination) pairs of at least `value` edges as classes for
    the time of the block (None: the product's layout): the class's launch against its narrower walk,
    measured in the stream rather than in the hooks alone."""
    if value is None:
        yield
        return
    kept = DeviceGrammar._best_kernel

    def with_floor(self, *args, **kwargs):
        kwargs.setdefault("class_min", value)
        return kept(self, *args, **kwargs)

    DeviceGrammar._best_kernel = with_floor
    try:
        yield
    finally:
        DeviceGrammar._best_kernel = kept


# the constraint's knobs: (flag's dest, OfficialConfig field, label in an arm's name)
KNOBS = (
    ("settle", "constraint_settle", "settle"),
    ("settle_positions", "constraint_settle_positions", "positions"),
    ("max_steps", "constraint_max_steps", "max_steps"),
    ("open_hold", "constraint_open_hold", "open"),
    ("class_min", VITERBI_CLASS_MIN, "class"),  # not a config field: `decode` applies it
)


def knob_arms(args) -> list[tuple[str, dict]]:
    """One (name tag, overrides) per combination of the knobs' values (arms of the same process); the
    tag names a knob's value only where it was given more than one."""
    out = []
    for values in itertools.product(*(getattr(args, dest) for dest, _, _ in KNOBS)):
        tag = "".join(
            f"/{label}{_off(v)}" for (dest, _, label), v in zip(KNOBS, values) if len(getattr(args, dest)) > 1
        )
        out.append((tag, {field: _off(v) for (_, field, _), v in zip(KNOBS, values)}))
    return out


def max_tokens_of(args, name: str, C: int) -> int:
    """A constrained row's budget: --max-tokens, or the schema's canvases (and the free answer's, thinking)."""
    return args.max_tokens or MAX_CANVASES[name] * C + args.think * tasks.ANSWER_CANVASES["arith"] * C


def run(args) -> dict:
    torch.set_num_threads(args.threads)
    bundle = load_bundle(args.model, device=args.device)
    if args.adapter:
        from canvasq.testbed.json_adapter import apply_adapter

        apply_adapter(bundle, args.adapter)
    C = bundle.canvas_length
    settings = Settings(schema_in_prompt=args.schema_in_prompt)
    limits = Limits.for_model(settings, args.model or settings.model)
    report: dict = {
        "commit": git_commit(),
        "hardware": args.hardware,
        "n": args.n,
        "seeds": args.seeds,
        "batch": args.batch,
        "threads": args.threads,
        "adapter": args.adapter,
        "schema_in_prompt": args.schema_in_prompt,
        "think": args.think,
        "stream": args.stream,
        "pooled": args.pooled,
        "free_last": args.free_last,
        "free_each": args.free_each,
        "rounds": args.rounds,
        "phases": args.phases,
        "split": args.split,
        "device": args.device,
        "arms": [],
    } | {field: [_off(v) for v in getattr(args, dest)] for dest, field, _ in KNOBS}
    arms = knob_arms(args)  # arms of the same process, alternating order by seed
    settle = arms[0][1]
    go = functools.partial(decode, stream=args.stream)
    clock = dict if args.phases else (lambda: None)  # a fresh dict per arm, or no clock
    # untimed: one batch free and one per schema first, so no timed arm pays Triton's compiles, the
    # allocator's first blocks or a grammar's compile (on the H200 the first arm took 16.7 s against 4.2);
    # with --stream the first arm's whole free stream too: its refills and encoder passes meet sizes a
    # batch does not (on an H100 a 600-row free stream ran 18-21 % slower first than last)
    sets = groups(args)
    warm = tasks.generate("arith", min(args.batch, args.n), args.seeds[0], split=args.split)
    for rows in [warm] + ([sets[0][2]] if args.stream else []):
        go(bundle, rows, None, tasks.ANSWER_CANVASES["arith"] * C, args.batch, args.seeds[0], limits)
    # and each schema's whole first stream: on an H100 a schema's first timed stream ran 30-60 % slower a
    # step than its next (encoder passes and forwards of sizes its warm batch never met); a knob's value
    # can be another compile (the rules' step cap, a class floor's Viterbi), so every arm warms
    warm_arms = [o for _, o in arms]
    for name, overrides in itertools.product(args.schemas, warm_arms):
        go(
            bundle,
            sets[0][2] if args.stream else warm,
            SCHEMAS[name],
            max_tokens_of(args, name, C),
            args.batch,
            args.seeds[0],
            limits,
            overrides,
            args.think,
        )
    freeze_heap()  # as a worker does once its model is loaded (Engine.bundle)
    rounds = [(r, seed, label if args.rounds == 1 else f"{label}/r{r + 1}", problems)
              for r in range(args.rounds) for seed, label, problems in sets]  # fmt: skip
    for k, (_, seed, label, problems) in enumerate(rounds):
        free_lines = functools.partial(
            go, bundle, problems, None, tasks.ANSWER_CANVASES["arith"] * C, args.batch, seed, limits
        )

        def free_run(free_lines=free_lines):
            occ, ph = [], clock()
            free, wall = free_lines(occupancy=occ, phases=ph)
            return free, wall, occupancy_of(occ) | (ph or {}), [tasks.arith_answer(r.text) for r in free]

        free, wall, free_occ, answers = free_run()
        for i, name in enumerate(args.schemas):
            if i and args.free_each:  # each schema's arms right after a free run of their own
                free, wall, free_occ, answers = free_run()
            ok = [asked(name, p, None, a) == truth(name, p) for p, a in zip(problems, answers)]
            report["arms"].append(
                arm_report(f"free/{name}/{label}", free, wall, problems, ok, None) | free_occ
            )
            max_tokens = max_tokens_of(args, name, C)
            # the schema's lines: (overrides, think, unconstrained) -> (results, wall)
            lines = functools.partial(
                go, bundle, problems, SCHEMAS[name], max_tokens, args.batch, seed, limits
            )
            for tag, overrides in arms if k % 2 == 0 else arms[::-1]:
                occ, ph = [], clock()
                res, cwall = lines(overrides, args.think, occupancy=occ, phases=ph)
                arm = constrained_arm(f"{name}{tag}/{label}", name, problems, res, cwall)
                arm |= {"max_tokens": max_tokens, **occupancy_of(occ), **(ph or {})}
                report["arms"].append(arm)
                print(json.dumps(report["arms"][-2:]), flush=True)
                _write(args.out, report)
                if args.samples:
                    _write_samples(args.out, f"{name}{tag}/{label}", problems, free, res)
            if args.prompt_only:
                occ = []
                res, cwall = lines(settle, args.think, True, occupancy=occ)
                arm = prompt_only_arm(f"prompt_only/{name}/{label}", name, problems, res, cwall)
                report["arms"].append(arm | occupancy_of(occ))
                print(json.dumps(report["arms"][-1]), flush=True)
                _write(args.out, report)
        if args.free_last:  # the same free lines once more, after every constrained arm of the group
            occ, ph = [], clock()
            again, wall = free_lines(occupancy=occ, phases=ph)
            ok = [tasks.arith_answer(r.text) == p.target for p, r in zip(problems, again)]
            report["arms"].append(
                arm_report(f"free_last/{label}", again, wall, problems, ok, None)
                | occupancy_of(occ)
                | (ph or {})
            )
            print(json.dumps(report["arms"][-1]), flush=True)
            _write(args.out, report)
    if args.trace:
        trace(args, bundle, limits, settle, sets[0])
    return report


def trace(args, bundle, limits, settle, group) -> None:
    """`--trace N`: the first N rows of the first group decoded once free and once under the first
    schema, each under `torch.profiler` (after the timed arms, so warm): per arm `<out>.trace_<arm>.txt`
    (wall, device-busy share, the ops by self host time and by device time) and its Chrome trace
    (`.json.gz`): where a constrained step's time goes that the hooks' host time does not explain."""
    import gzip

    from torch.profiler import ProfilerActivity, profile

    seed, _, problems = group
    name, C = args.schemas[0], bundle.canvas_length
    rows = problems[: args.trace]
    arms = {
        "free": (None, tasks.ANSWER_CANVASES["arith"] * C, None, False),
        name: (SCHEMAS[name], max_tokens_of(args, name, C), settle, args.think),
    }
    cuda = args.device.startswith("cuda")
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    for arm, (schema, max_tokens, overrides, think) in arms.items():
        occ: list = []
        with profile(activities=acts) as prof:
            t0 = time.perf_counter()
            decode(
                bundle,
                rows,
                schema,
                max_tokens,
                args.batch,
                seed,
                limits,
                overrides,
                think,
                stream=args.stream,
                occupancy=occ,
            )
            if cuda:
                torch.cuda.synchronize()
            wall = time.perf_counter() - t0
        events = prof.key_averages()
        busy = sum(e.self_device_time_total for e in events) / 1e6
        head = f"{arm}: {len(rows)} rows, wall {wall:.3f} s, {len(occ)} steps, device busy {busy:.3f} s"
        tables = [
            events.table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=60),
            events.table(sort_by="self_device_time_total", row_limit=40, max_name_column_width=60)
            if cuda
            else "",
        ]
        stem = args.out.parent / f"{args.out.stem}.trace_{arm}"
        Path(f"{stem}.txt").write_text(head + "\n" + "\n".join(tables))
        raw = Path(f"{stem}.json")
        prof.export_chrome_trace(str(raw))
        with open(raw, "rb") as f, gzip.open(f"{raw}.gz", "wb") as g:
            g.write(f.read())
        raw.unlink()
        print(head, flush=True)


def groups(args) -> list[tuple[int, str, list]]:
    """The arms' row sets: (decode seed, label, problems) per seed, or with `--pooled` one set of every
    seed's problems (as one file of all the lines: with `--stream`, one stream and one tail), decoded
    with the first seed."""
    sets = [
        (seed, f"seed{seed}", tasks.generate("arith", args.n, seed, split=args.split)) for seed in args.seeds
    ]
    if not args.pooled:
        return sets
    label = "seeds" + "-".join(str(s) for s in args.seeds)
    return [(args.seeds[0], label, [p for _, _, ps in sets for p in ps])]


def occupancy_of(occ: list) -> dict:
    """A stream's decoder steps and their mean share of slots live (nothing without --stream)."""
    if not occ:
        return {}
    return {
        "steps": len(occ),
        "occupancy_mean": sum(live / slots for live, slots in occ) / len(occ),
        "steps_under_half": sum(live * 2 < slots for live, slots in occ),  # the tail's steps
    }


def _quantile(xs: list[int], q: float) -> int:
    """The q-quantile of `xs` (the nearest rank)."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0


def _write(path: Path, report: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")


def _write_samples(path: Path, arm: str, problems, free, res) -> None:
    """Every row's free and constrained text beside the report (`<out>.samples.jsonl`)."""
    with open(path.with_suffix(".samples.jsonl"), "a") as f:
        for p, a, b in zip(problems, free, res):
            row = {
                "arm": arm,
                "uid": p.uid,
                "target": p.target,
                "free": a.text,
                "doc": b.text,
                "thought": b.reasoning,
                "error": b.error,
            }
            f.write(json.dumps(row) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--n", type=int, default=48, help="arith problems per seed")
    ap.add_argument(
        "--seeds", type=int, nargs="+", default=[1], help="the split's streams (problems and draws)"
    )
    ap.add_argument(
        "--split",
        default="eval",
        choices=tasks.SPLITS,
        help="the prompts' split (tune on dev, claim on eval)",
    )
    ap.add_argument("--batch", type=int, default=16, help="rows decoded together (with --stream: slots)")
    ap.add_argument(
        "--stream",
        action="store_true",
        help="each arm's rows through one continuous-batching stream of --batch slots (the worker's loop) "
        "instead of batches of --batch rows run to their slowest row",
    )
    ap.add_argument(
        "--free-last",
        action="store_true",
        help="the free lines decoded again after the constrained arms (an arm's place in the process "
        "moves its wall by several percent: compare each arm with both free runs)",
    )
    ap.add_argument(
        "--free-each",
        action="store_true",
        help="the free lines decoded again before each schema after the first, so every constrained arm "
        "sits between two free runs (read against their mean: benchmarks/overhead_ratios.py)",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="every group's arms this many times over, in order (labels /r1, /r2, ...): on a GPU where a "
        "testbed step is host-bound, identical arms of one process can move by 1.7x, so "
        "read the ratios of each round's arms and their spread",
    )
    ap.add_argument(
        "--phases",
        action="store_true",
        help="with --stream: each arm's host ms a decoder step by phase (forward, mask, sample, step's own "
        "time with its sync, encode, ...; benchmarks/phases.py): where a constrained step's extra time goes",
    )
    ap.add_argument(
        "--pooled",
        action="store_true",
        help="every seed's rows as one arm (one file of all the lines; with --stream one stream), "
        "decoded with the first seed, instead of an arm per seed",
    )
    ap.add_argument(
        "--max-tokens", type=int, default=None, help="of a constrained row (default: MAX_CANVASES canvases)"
    )
    ap.add_argument("--schemas", nargs="+", default=["answer", "change", "totals"], choices=list(SCHEMAS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--class-min",
        type=int,
        nargs="+",
        default=[-1],
        help="the Viterbi's class floor on CUDA (edges a (source, destination) pair needs to be scored "
        "as one class; -1: the product's layout); several values: one arm each, same process",
    )
    for flag, knob in (
        ("--settle", "constraint_settle"),
        ("--settle-positions", "constraint_settle_positions"),
        ("--max-steps", "constraint_max_steps"),
        ("--open-hold", "constraint_open_hold"),
    ):
        default = getattr(OfficialConfig, knob)
        ap.add_argument(
            flag,
            type=int,
            nargs="+",
            default=[-1 if default is None else default],
            help=f"OfficialConfig.{knob} (-1: off); several values: one arm each, same process"
            + (
                " (given for a 256-token canvas: 48 is 6 steps at the testbed's 32)"
                if knob == "constraint_max_steps"
                else ""
            ),
        )
    ap.add_argument(
        "--think",
        action="store_true",
        help="constrained lines with reasoning_effort medium (the working written free before the "
        "document), the free answer's canvases added to max_tokens",
    )
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", default=None)
    ap.add_argument("--adapter", default=None, help="a LoRA merged into the model for every arm")
    ap.add_argument("--samples", action="store_true", help="also write <out>.samples.jsonl (texts)")
    ap.add_argument(
        "--prompt-only",
        action="store_true",
        help="per schema, also an arm of its lines decoded without the constraint (the same prompts: the "
        "schema shown, thinking first with --think): the constraint's own cost, apart from the document's",
    )
    ap.add_argument(
        "--no-schema-in-prompt",
        dest="schema_in_prompt",
        action="store_false",
        help="constrained rows without their schema shown in the prompt (CANVASQ_SCHEMA_IN_PROMPT=false)",
    )
    ap.add_argument(
        "--trace",
        type=int,
        default=0,
        metavar="N",
        help="after the timed arms, N rows free and under the first schema with torch.profiler "
        "(<out>.trace_<arm>.txt, .json.gz)",
    )
    ap.add_argument("--hardware", default="CPU, 2 cores")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    _write(args.out, run(args))


if __name__ == "__main__":
    main()
