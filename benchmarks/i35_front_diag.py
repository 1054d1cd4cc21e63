"""Issue 35, item 1: where a revising front (`front="revise"`) loses answers. Dev split only: per
request, whether it hit the `front_wait` bound (`front_timeouts`) and whether it is right, for pipe and
Funnel on 100 arith problems (seed 2), batches of 16, max_tokens 160, fp32, 1 thread.

    python3 benchmarks/i35_front_diag.py > benchmarks/results/cpu_2026-12-03_i35_front_revise_dev_diag.txt
"""

from __future__ import annotations

import torch

from canvasq.decoders import DecodeBatch, DecodeRequest, run_batch
from canvasq.model.loading import load_bundle
from canvasq.testbed import tasks


def main(n: int = 100, seed: int = 2, task: str = "arith") -> None:
    torch.set_num_threads(1)
    bundle = load_bundle("models/testbed")
    problems = tasks.generate(task, n, seed, split="dev")
    reqs = [DecodeRequest(p.uid, bundle.encode_prompt(p.prompt, task), 160, task) for p in problems]
    for name in ("pipe", "funnel"):
        res = []
        for i in range(0, len(reqs), 16):
            res += run_batch(
                bundle, DecodeBatch(reqs[i : i + 16], seed=seed), decoder=name, overrides={"front": "revise"}
            )
        ok = [tasks.verify(p, r.text) for p, r in zip(problems, res)]
        hit = [r.stats.get("front_timeouts", 0) > 0 for r in res]
        right_hit = sum(o for o, h in zip(ok, hit) if h)
        right_rest = sum(o for o, h in zip(ok, hit) if not h)
        print(
            f"{name} {task} dev seed {seed} n {n}: accuracy {sum(ok) / n:.2f}; "
            f"{sum(hit)} requests hit the bound ({right_hit} right); the other {n - sum(hit)}: {right_rest} right; "
            f"canvases accepted by the rule {sum(r.stats.get('front_accepts', 0) for r in res)}, "
            f"at the bound {sum(r.stats.get('front_timeouts', 0) for r in res)}; "
            f"revised positions per request {sum(r.stats.get('revised', 0) for r in res) / n:.2f}"
        )


if __name__ == "__main__":
    main()
