"""How many steps official's canvases take, and what ends them (issue 35: how far the native sampler is
from its floor on the testbed).

HF's stopping rule ends a canvas on the first step whose argmax equals the step before's and whose mean
entropy is under the confidence threshold, so no canvas ends before its second step. Per canvas this
prints the steps it ran, the last step on which its argmax changed and the first on which its mean
entropy was under the threshold; a canvas is "stability-bound" when its entropy was low by the step
after its argmax last changed (only a surer first step would end it sooner), else "entropy-bound"
(a surer model would end it sooner).

    python3 benchmarks/official_steps.py --split dev --seed 5 --n 48 [--override 'adapter_path="DIR"']
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics

import torch

from canvasq.decoders.official import OfficialDecoder
from canvasq.decoders.registry import make_config
from canvasq.decoders.types import DecodeBatch, DecodeRequest
from canvasq.model.loading import load_bundle
from canvasq.testbed import tasks


def trace(bundle, overrides: dict, split: str, seed: int, n: int, batch: int) -> dict:
    """{(custom_id, canvas number): [(mean entropy, argmax) per step]} over arith and code."""
    log: dict = collections.defaultdict(list)

    class Traced(OfficialDecoder):
        def _stopped(self, seqs, idx, argmax, entropy):
            for k, s in enumerate(seqs):
                log[(s.req.custom_id, s.spawned)].append((float(entropy[k].mean()), argmax[k].tolist()))
            return super()._stopped(seqs, idx, argmax, entropy)

    dec = Traced(bundle, make_config("official", overrides))
    for task in ("arith", "code"):
        problems = tasks.generate(task, n, seed, split)
        max_tokens = tasks.ANSWER_CANVASES[task] * bundle.canvas_length
        reqs = [
            DecodeRequest(p.uid, bundle.encode_prompt(p.prompt, task), max_tokens, task) for p in problems
        ]
        for i in range(0, n, batch):
            dec.decode(DecodeBatch(reqs[i : i + batch], seed=seed * 7919 + i))
    return log


def summary(log: dict, threshold: float) -> dict:
    out = {}
    for task in ("arith", "code"):
        rows = []
        for (uid, _), steps in log.items():
            if not uid.startswith(task):
                continue
            changed = max([i for i in range(1, len(steps)) if steps[i][1] != steps[i - 1][1]] + [0])
            sure = next((i for i, (h, _) in enumerate(steps) if h < threshold), len(steps))
            rows.append((len(steps), changed, sure))
        out[task] = {
            "canvases": len(rows),
            "steps_mean": round(statistics.mean(r[0] for r in rows), 3),
            "steps_histogram": dict(sorted(collections.Counter(r[0] for r in rows).items())),
            "last_argmax_change_mean": round(statistics.mean(r[1] for r in rows), 3),
            "first_sure_step_mean": round(statistics.mean(r[2] for r in rows), 3),
            "stability_bound": sum(r[2] <= r[1] + 1 for r in rows),
            "entropy_bound": sum(r[2] > r[1] + 1 for r in rows),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--split", default="dev", choices=tasks.SPLITS)
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--n", type=int, default=48, help="problems per task")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--override", default="", help="official's knobs, as an --arm's key=value list")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    overrides = {k: json.loads(v) for k, v in (kv.split("=", 1) for kv in args.override.split(",") if kv)}
    bundle = load_bundle(None)
    dec = OfficialDecoder(bundle, make_config("official", overrides))
    threshold = dec.sampler.confidence_threshold or 0.0
    log = trace(bundle, overrides, args.split, args.seed, args.n, args.batch)
    print(
        json.dumps({"split": args.split, "seed": args.seed, "n": args.n, **summary(log, threshold)}, indent=1)
    )


if __name__ == "__main__":
    main()
