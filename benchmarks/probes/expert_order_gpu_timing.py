"""GPU probe: the FP8 experts' routing order (`canvasq.model.fp8.expert_order`) by each method, at
E = 128 experts, top-8, as a forward of T tokens routes them: "sort" (torch's stable sort of the
int64 ids), "narrow" (the same sort on one-byte keys) and "count" (`align_routing` at one-row
blocks). Ids: each token's 8 distinct experts from a softmax over skewed logits (torch seed 0).
Outputs checked first: every method gives the int64 sort's order, ends and inverse. Timing:
`benchmarks/kernels/_common.time_ms` (median; eager launches, as a forward that cannot be captured
runs them, and from one CUDA graph with --graph).

    python benchmarks/probes/expert_order_gpu_timing.py 4096,8192,16384     # H100 / H200
    python benchmarks/probes/expert_order_gpu_timing.py --quick             # CPU: 64 tokens
"""

import argparse
import functools
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "kernels"))
import _common as C  # first: on a machine without a GPU it makes the kernels interpreted
import torch

from canvasq.model.fp8 import ORDERS, expert_order


def routed(tokens: int, experts: int = 128, top_k: int = 8) -> torch.Tensor:
    """[tokens, top_k] expert ids, distinct per token, some experts far more popular than others."""
    torch.manual_seed(0)
    skew = torch.randn(experts, device=C.DEVICE) * 1.5
    logits = torch.randn(tokens, experts, device=C.DEVICE) + skew
    return logits.topk(top_k, dim=-1).indices


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tokens", nargs="?", default="4096,8192,16384")
    ap.add_argument("--quick", action="store_true", help="64 tokens (on CPU: interpreted)")
    ap.add_argument("--graph", action="store_true", help="also time each method from a CUDA graph")
    a = ap.parse_args()
    rows = []
    for t in [64] if a.quick else [int(v) for v in a.tokens.split(",")]:
        ids = routed(t)
        want = expert_order(ids, 128, kernel=False, method="sort")
        row = {"tokens": t}
        for method in ORDERS:
            got = expert_order(ids, 128, kernel=True, method=method)
            assert all(torch.equal(g, w) for g, w in zip(got, want)), method
            call = functools.partial(expert_order, ids, 128, True, method)
            row[f"{method}_us"] = C.time_ms(lambda _, f=call: f()) * 1e3
            if a.graph and C.ON_GPU:
                row[f"{method}_graph_us"] = C.time_ms(lambda _, f=call: f(), graph=True) * 1e3
        rows.append(row)
        print(json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "expert_order.json"), "w") as f:
            json.dump({"bench": "expert_order", **C.device_info(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
