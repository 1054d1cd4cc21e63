"""Accuracy of a decoder on fresh testbed problems: `canvasq eval --task arith --n 200 --seed 1`.

Reports accuracy, mean generated tokens, forwards (every model pass: decoder denoising steps and
encoder commit passes), tokens per forward and wall tok/s; `--json` ends with one JSON line.
Problems come from the eval split (`tasks.generate`'s default): never a training or dev problem.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

from canvasq.testbed import tasks


@dataclass
class EvalReport:
    task: str
    decoder: str
    n: int
    seed: int
    accuracy: float
    tokens: int
    mean_tokens: float
    forwards: int
    tok_per_forward: float
    seconds: float
    tok_per_s: float

    def as_dict(self) -> dict:
        return asdict(self)


def evaluate(
    bundle,
    task: str,
    n: int,
    seed: int,
    decoder: str = "official",
    batch_size: int = 16,
    max_tokens: int | None = None,
    overrides: dict | None = None,
) -> EvalReport:
    """Every decoder through `canvasq.decoders.run_batch` (the official arm is HF `generate()`
    unchanged; its entropy bound is the override `{"entropy_bound": b}`). `forwards` sums, over the
    chunks, the passes the chunk's slowest request needed (prefill and encoder passes included)."""
    from canvasq.decoders import run_batch
    from canvasq.decoders.types import DecodeBatch, DecodeRequest

    problems = tasks.generate(task, n, seed)
    max_tokens = (
        max_tokens or tasks.ANSWER_CANVASES[tasks.TASK_ALIASES.get(task, task)] * bundle.canvas_length
    )
    correct = tokens = forwards = 0
    t0 = time.perf_counter()
    for start in range(0, n, batch_size):
        chunk = problems[start : start + batch_size]
        reqs = [
            DecodeRequest(p.uid, bundle.encode_prompt(p.prompt, p.task), max_tokens, p.task) for p in chunk
        ]
        results = run_batch(bundle, DecodeBatch(reqs, seed=seed * 100_003 + start), decoder, overrides)
        forwards += max(r.forwards for r in results)
        tokens += sum(_answer_len(r.token_ids, bundle.eos_id, bundle.pad_id) for r in results)
        correct += sum(tasks.verify(p, r.text) for p, r in zip(chunk, results))
    secs = time.perf_counter() - t0
    return EvalReport(
        task=task,
        decoder=decoder,
        n=n,
        seed=seed,
        accuracy=correct / n,
        tokens=tokens,
        mean_tokens=tokens / n,
        forwards=forwards,
        tok_per_forward=tokens / max(forwards, 1),
        seconds=round(secs, 2),
        tok_per_s=tokens / secs,
    )


def _answer_len(ids: list[int], eos: int, pad: int) -> int:
    """Generated tokens up to and including EOS (what the user receives, plus the stop token)."""
    n = 0
    for i in ids:
        if i == pad:
            break
        n += 1
        if i == eos:
            break
    return n


def main(argv=None):
    """`python -m canvasq.testbed.eval MODEL --n 128 --batch 64 [--bounds 0.1,1,4]`: the official
    sampler's accuracy per task, optionally swept over its entropy bound (GPU-friendly batches)."""
    import argparse
    import json

    import torch

    from canvasq.model.loading import load_bundle

    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--n", type=int, default=128)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--bounds", default="")
    args = ap.parse_args(argv)
    bundle = load_bundle(args.model, device="cuda" if torch.cuda.is_available() else "cpu")
    for task in tasks.TASKS:
        print(
            json.dumps(evaluate(bundle, task, args.n, args.seed, batch_size=args.batch).as_dict()), flush=True
        )
    for bound in (float(b) for b in args.bounds.split(",") if b):
        for task in tasks.TASKS:
            over = {"entropy_bound": bound}
            r = evaluate(bundle, task, args.n, args.seed, batch_size=args.batch, overrides=over)
            print(json.dumps({"entropy_bound": bound, **r.as_dict()}), flush=True)


if __name__ == "__main__":
    main()
