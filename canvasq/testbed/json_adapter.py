"""The testbed's JSON adapter: a LoRA that teaches the 9M testbed to answer arith problems as JSON
documents, so `response_format` rows on it measure the constraint rather than a model that never saw
JSON (issue 36; BENCHMARKS.md, "Structured output").

The testbed was trained to write its working column by column and end with `#### N`. Held to a schema,
it has to put that answer inside a document it never saw. This adapter is trained, with the base
checkpoint's own objective (`train_loss.denoise_loss`, one canvas, self-conditioning), on train-split
problems only (`tasks.generate(..., split="train")`: never a dev or eval problem), each answer written
in one of these forms (`FORMS`, drawn by `--weights`):

    free           the checkpoint's own answer (working, then `#### N`): keeps the free format
    worked         {"reasoning":"<the working>","answer":N}
    worked_change  {"reasoning":"<the working>","change":"gained"|"lost"|"same"}
    answer         {"answer":N}              (no working: what the model can do without it)
    change         {"change":"gained"|"lost"|"same"}
    think          the free answer, a newline, then {"answer":N} (the working first, as the
                   checkpoint writes it; the document after it: a line's reasoning_effort)
    think_change   the same, then {"change":"gained"|"lost"|"same"}
    think_totals   the same, then {"totals":[the counts the working states]} (the last is N)

plus `--code-share` of code problems in their own free form, so code answers are not forgotten. The
documents are compact (no whitespace), keys in this order: the text `decoders.structured` holds
canvases to. Each JSON form's prompt is the problem with its schema (`FORM_SCHEMAS`) shown by the
service's own function (`decoders.schema_text.shown_prompt`: `JSON {"answer":integer}` on a line of
its own before the problem), exactly what a `response_format` line's prompt becomes at validation; the
free form (and code) has none. So the adapter learns the instruction -> form: with one plain prompt for five forms, the
model could not know which one a constrained canvas wanted (BENCHMARKS.md, "Issue 36's accuracy bar").

The adapter is a LoRA on the decoder's attention and MLP projections (as `d2f_adapter`); the encoder
shares those weight tensors, so it runs the same wrapped projections while training
(`share_with_encoder`: what the merge gives it at inference). It is merged into
the weights for use: `merge` writes a model directory with it merged (serve it with
`CANVASQ_MODEL=DIR` or `--model DIR`), and `apply_adapter` merges it into a loaded bundle (what
`benchmarks/structured_output.py --adapter` does for both its free and its constrained arms).

Status (BENCHMARKS.md, "Structured output"): ~1,800 CPU steps at batch 16 taught the format but not
yet the accuracy (constrained 38 % against the base's 81 % free on 32 problems); no adapter is
committed. Train on a GPU (minutes there are thousands of steps at batch 256).

    python -m canvasq.testbed.json_adapter train --out /tmp/json_adapter --minutes 20
    python -m canvasq.testbed.json_adapter merge --adapter models/testbed/json_adapter --out /tmp/tb-json
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from canvasq.decoders.schema_text import shown_prompt
from canvasq.testbed import tasks
from canvasq.testbed.config import BOS_ID, EOS_ID, PAD_ID, SEP_ID

DEFAULT_MODEL = Path(__file__).resolve().parents[2] / "models" / "testbed"
_START = re.compile(r" has (\d+) ")
# the same modules as d2f_adapter: the decoder's (its weights are the encoder's too: one merge)
TARGETS = r".*decoder\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)"


def compact(doc: dict) -> str:
    """A document as constrained decoding writes it: no whitespace, keys in the dict's order."""
    return json.dumps(doc, separators=(",", ":"))


def working(p: tasks.Problem) -> str:
    """An arith answer's working: the reference answer without its final `#### N` line."""
    return p.answer.rsplit("\n####", 1)[0]


def change(p: tasks.Problem) -> str:
    """Whether the story ends with more, fewer or as many items as it started with."""
    m = _START.search(p.prompt)
    if m is None or p.target is None:
        raise ValueError(f"{p.uid}: not an arith story")
    start = int(m.group(1))
    return "gained" if p.target > start else "lost" if p.target < start else "same"


def totals(p: tasks.Problem) -> list[int]:
    """The counts an arith answer's working states, in order (each sentence's "N items."; the last six):
    the start, each step's result, a side count; the last is the answer."""
    return [int(x) for x in re.findall(r"(\d+) [a-z]+\.", working(p))][-6:]


def object_schema(props: dict) -> dict:
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


_CHANGE = {"enum": ["gained", "lost", "same"]}
_TOTALS = {"type": "array", "items": {"type": "integer"}, "maxItems": 6}
_CHANGE_SCHEMA = object_schema({"change": _CHANGE})
# the schema of each JSON form (what a response_format line asks; benchmarks/structured_output.py's too)
FORM_SCHEMAS: dict[str, dict] = {
    "worked": object_schema({"reasoning": {"type": "string"}, "answer": {"type": "integer"}}),
    "worked_change": object_schema({"reasoning": {"type": "string"}, "change": _CHANGE}),
    "answer": object_schema({"answer": {"type": "integer"}}),
    "change": _CHANGE_SCHEMA,
}
FORM_SCHEMAS["totals"] = object_schema({"totals": _TOTALS})
# the arith answer first, then a field of another shape (an enum, an array)
FORM_SCHEMAS["answer_change"] = object_schema({"answer": {"type": "integer"}, "change": _CHANGE})
FORM_SCHEMAS["answer_totals"] = object_schema({"answer": {"type": "integer"}, "totals": _TOTALS})
# the same lines asked, answered after the working (a line's reasoning_effort: `structured.THINK`)
FORM_SCHEMAS |= {
    "think": FORM_SCHEMAS["answer"],
    "think_change": _CHANGE_SCHEMA,
    "think_totals": FORM_SCHEMAS["totals"],
    "think_answer_change": FORM_SCHEMAS["answer_change"],
    "think_answer_totals": FORM_SCHEMAS["answer_totals"],
}

FORMS: dict[str, Callable[[tasks.Problem], str]] = {
    "free": lambda p: p.answer,
    "worked": lambda p: compact({"reasoning": working(p), "answer": p.target}),
    "worked_change": lambda p: compact({"reasoning": working(p), "change": change(p)}),
    "answer": lambda p: compact({"answer": p.target}),
    "change": lambda p: compact({"change": change(p)}),
    # the checkpoint's own answer, then the document: what a constrained row with `think` decodes
    # (the working free, under `structured.THINK`, then the schema from the first "{")
    "think": lambda p: p.answer + "\n" + compact({"answer": p.target}),
    "think_change": lambda p: p.answer + "\n" + compact({"change": change(p)}),
    "think_totals": lambda p: p.answer + "\n" + compact({"totals": totals(p)}),
    "think_answer_change": lambda p: p.answer + "\n" + compact({"answer": p.target, "change": change(p)}),
    "think_answer_totals": lambda p: p.answer + "\n" + compact({"answer": p.target, "totals": totals(p)}),
}
DEFAULT_WEIGHTS = "free=0.4,worked=0.3,worked_change=0.1,answer=0.1,change=0.1"


def parse_weights(text: str) -> dict[str, float]:
    """'free=0.4,worked=0.3' -> {form: share}, normalised to sum 1 (unknown forms are an error)."""
    weights: dict[str, float] = {}
    for part in filter(None, (x.strip() for x in text.split(","))):
        name, _, value = part.partition("=")
        if name not in FORMS:
            raise ValueError(f"unknown form {name!r}; known: {', '.join(FORMS)}")
        weights[name] = float(value)
    total = sum(weights.values())
    if not weights or total <= 0 or any(v < 0 for v in weights.values()):
        raise ValueError(f"--weights {text!r}: give non-negative shares with a positive sum")
    return {k: v / total for k, v in weights.items()}


def form_prompt(prompt: str, form: str, tagged: bool = True) -> str:
    """The prompt of a problem answered in `form`, as the service builds it for a line whose
    response_format is the form's schema (`shown_prompt`); the free form's is the problem alone."""
    return shown_prompt(prompt, FORM_SCHEMAS.get(form), tagged)


def training_texts(
    n_arith: int, n_code: int, seed: int, weights: dict[str, float], tagged: bool = True
) -> list[tuple[str, str, str]]:
    """(prompt, answer text, form) for `n_arith` train-split arith problems, each in a form drawn by
    `weights` (its prompt with the form's schema shown: `form_prompt`; `tagged=False`: the plain problem
    in every form, the adapter before the instruction), and `n_code` train-split code problems in their
    free form."""
    rng = random.Random(f"json-adapter:{seed}")
    names, shares = list(weights), list(weights.values())
    rows = []
    for p in tasks.generate("arith", n_arith, seed, split="train"):
        form = rng.choices(names, shares)[0]
        rows.append((form_prompt(p.prompt, form, tagged), FORMS[form](p), form))
    rows += [(p.prompt, p.answer, "code") for p in tasks.generate("code", n_code, seed, split="train")]
    return rows


def build_pool(rows: list[tuple[str, str, str]], tokenizer, canvas: int):
    """`train_data.build_pool`'s matrix for these rows: `<bos> prompt <sep>` ‖ answer `<eos>`, padded
    to whole canvases (seq, prompt lengths, answer canvases)."""
    prompts = tokenizer([r[0] for r in rows], add_special_tokens=False)["input_ids"]
    answers = tokenizer([r[1] for r in rows], add_special_tokens=False)["input_ids"]
    pairs = [([BOS_ID, *p, SEP_ID], [*a, EOS_ID]) for p, a in zip(prompts, answers)]
    max_p = max(len(p) for p, _ in pairs)
    max_c = max(math.ceil(len(a) / canvas) for _, a in pairs)
    seq = np.full((len(pairs), max_p + max_c * canvas), PAD_ID, dtype=np.int64)
    plen = np.zeros(len(pairs), dtype=np.int64)
    ncan = np.zeros(len(pairs), dtype=np.int64)
    for i, (p, a) in enumerate(pairs):
        seq[i, : len(p)] = p
        seq[i, len(p) : len(p) + len(a)] = a
        plen[i], ncan[i] = len(p), math.ceil(len(a) / canvas)
    return seq, plen, ncan


def train(args) -> dict:
    """Train the LoRA over `args.model`'s checkpoint; saved to `args.out` with a `train_report.json`."""
    import torch
    from transformers import AutoTokenizer

    from canvasq.testbed.train import _run_log, train_phase
    from canvasq.testbed.train_data import Batches
    from canvasq.testbed.train_loss import digit_weights

    torch.set_num_threads(args.threads)
    device = "cuda" if torch.cuda.is_available() and not args.cpu else "cpu"
    torch.manual_seed(args.seed)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = _run_log(out / "train_log.txt")
    weights = parse_weights(args.weights)
    tok = AutoTokenizer.from_pretrained(args.model)
    rows = training_texts(args.n_arith, args.n_code, args.seed, weights, not args.untagged)
    model = _base_model(args.model, device)
    C, V = int(model.config.canvas_length), int(model.config.text_config.vocab_size)
    seq, plen, ncan = build_pool(rows, tok, C)
    batches = Batches(seq, plen, ncan, C, V, device)
    log(f"data: {len(rows)} rows (weights {weights}), max row {seq.shape[1]} tokens")
    peft_model = _lora(model, args.init, args.rank)
    restore = share_with_encoder(peft_model.base_model.model)
    report = train_phase(
        peft_model.base_model.model,
        [p for p in peft_model.parameters() if p.requires_grad],
        batches,
        minutes=args.minutes,
        batch=args.batch,
        lr=args.lr,
        n_canvases=1,
        canvas=C,
        sc_prob=0.5,
        gen=gen,
        log=log,
        tag="json",
        token_weight=digit_weights(tok, V, args.digit_weight, device),
    )
    restore()
    peft_model.save_pretrained(str(out))
    report.update(
        device=device,
        base=str(args.model),
        rows=len(rows),
        weights=weights,
        seed=args.seed,
        init=args.init,
        rank=args.rank,
        batch=args.batch,
        lr=args.lr,
        split="train",
        schema_in_prompt=not args.untagged,
    )
    (out / "train_report.json").write_text(json.dumps(report, indent=2) + "\n")
    log(json.dumps(report))
    return report


def _lora(model, init: str | None, rank: int):
    """The model wrapped in a trainable LoRA: `init`'s adapter continued (its rank and targets), else a
    fresh one of `rank` on `TARGETS`."""
    from peft import LoraConfig, PeftModel, get_peft_model

    if init:
        peft_model = PeftModel.from_pretrained(model, init, is_trainable=True)
    else:
        lora = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=TARGETS)
        peft_model = get_peft_model(model, lora)
    peft_model.train()
    return peft_model


def _base_model(path, device: str):
    """The checkpoint in fp32 on `device` (eager experts on the CPU: grouped_mm takes ~10x there)."""
    import torch
    from transformers import DiffusionGemmaForBlockDiffusion

    model: Any = DiffusionGemmaForBlockDiffusion.from_pretrained(path, dtype=torch.float32)
    model = model.to(device)
    if device == "cpu":
        model.set_experts_implementation("eager")
    return model


_PROJECTIONS = tuple(f"self_attn.{x}_proj" for x in "qkvo") + tuple(
    f"mlp.{x}_proj" for x in ("gate", "up", "down")
)


def share_with_encoder(model) -> Callable[[], None]:
    """Let the encoder run the decoder's LoRA-wrapped projections while training; returns the undo.

    Encoder and decoder layers are distinct modules over the same weight tensors, so a merged adapter
    changes both; peft wraps only the decoder's. Trained that way, the encoder would read the context
    with base weights, and the merged model (encoder changed too) would read it differently from
    training. Sharing the wrapped modules trains what the merge runs. Undo before saving: the adapter's
    keys stay the decoder's."""
    enc, dec = model.model.encoder.language_model.layers, model.model.decoder.layers
    undo: list[tuple[object, str, object]] = []
    for e_layer, d_layer in zip(enc, dec):
        for path in _PROJECTIONS:
            part, name = path.split(".")
            e_parent, d_parent = getattr(e_layer, part), getattr(d_layer, part)
            if getattr(d_parent, name, None) is None:  # a layer without it (keys as values)
                continue
            if getattr(e_parent, name).weight is not getattr(d_parent, name).weight:
                raise ValueError(f"encoder and decoder {path} do not share weights: merge would not match")
            undo.append((e_parent, name, getattr(e_parent, name)))
            setattr(e_parent, name, getattr(d_parent, name))

    def restore() -> None:
        for parent, name, module in undo:
            setattr(parent, name, module)

    return restore


def apply_adapter(bundle, adapter_dir: str | Path):
    """`bundle` with the LoRA in `adapter_dir` merged into its plain weights (the official decoder's);
    call before any decoder runs on it."""
    from canvasq.model.loading import merge_adapter

    bundle.hf_model = merge_adapter(bundle.hf_model, Path(adapter_dir))
    return bundle


def merge(args) -> Path:
    """A model directory: `args.model` with the adapter merged (bf16 safetensors, its tokenizer)."""
    import torch
    from peft import PeftModel
    from transformers import DiffusionGemmaForBlockDiffusion

    from canvasq.testbed.train import save_model

    base = DiffusionGemmaForBlockDiffusion.from_pretrained(args.model, dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, str(args.adapter)).merge_and_unload().eval()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    save_model(merged, out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(args.model) / name, out / name)
    print(f"wrote {out} ({args.model} + {args.adapter}); its official decoder answers in JSON")
    return out


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m canvasq.testbed.json_adapter",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = ap.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train the LoRA on train-split problems")
    t.add_argument("--out", required=True, help="adapter directory to write (peft format)")
    t.add_argument("--model", default=str(DEFAULT_MODEL), help="base checkpoint directory")
    t.add_argument("--minutes", type=float, default=20.0, help="wall time of training")
    t.add_argument("--weights", default=DEFAULT_WEIGHTS, help="shares of the answer forms (FORMS)")
    t.add_argument("--n-arith", type=int, default=40_000, help="train-split arith problems")
    t.add_argument("--n-code", type=int, default=4_000, help="train-split code problems (free form)")
    t.add_argument("--seed", type=int, default=0, help="problem stream and training seed")
    t.add_argument("--rank", type=int, default=8, help="LoRA rank (alpha = 2 x rank)")
    t.add_argument("--init", default=None, help="continue training this adapter directory")
    t.add_argument("--batch", type=int, default=64)
    t.add_argument("--lr", type=float, default=2e-3)
    t.add_argument("--digit-weight", type=float, default=4.0, help="CE weight of the digit tokens")
    t.add_argument("--threads", type=int, default=1, help="torch threads on the CPU")
    t.add_argument("--cpu", action="store_true", help="train on the CPU even where CUDA is present")
    t.add_argument(
        "--untagged", action="store_true", help="no schema in the JSON forms' prompts (the old adapter)"
    )
    m = sub.add_parser("merge", help="write a model directory with the adapter merged")
    m.add_argument("--adapter", required=True, help="the trained adapter directory")
    m.add_argument("--out", required=True, help="model directory to write")
    m.add_argument("--model", default=str(DEFAULT_MODEL), help="base checkpoint directory")
    return ap


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    if args.command == "train":
        train(args)
    else:
        merge(args)


if __name__ == "__main__":
    main()
