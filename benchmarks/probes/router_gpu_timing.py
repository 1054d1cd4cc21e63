"""GPU probe (2026-11-30, session 8): the router's selection, torch (fp32 softmax, then torch.topk: three
kernels on CUDA) against `canvasq.kernels.router.router_topk` (one), at E = 128 experts, top-8, bf16
logits (random normal * 2, torch seed 0). Timing: `benchmarks/kernels/_common.time_ms` (an event pair
around each of 50 calls queued back to back, median). Outputs checked first: the same probabilities
(2e-6 relative) and the same set of experts per row.

    python benchmarks/probes/router_gpu_timing.py 8,256,1024,4096     # H200
"""

import os
import sys

import torch

from canvasq.kernels.router import router_topk_launch, router_topk_reference

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "kernels"))
from _common import time_ms


def main():
    rows = [int(v) for v in (sys.argv[1] if len(sys.argv) > 1 else "256").split(",")]
    torch.manual_seed(0)
    for n in rows:
        logits = (torch.randn(n, 128, device="cuda") * 2).to(torch.bfloat16)
        p, ids = router_topk_launch(logits, 8)
        want_p, want_ids = router_topk_reference(logits, 8)
        torch.testing.assert_close(p, want_p, rtol=2e-6, atol=1e-7)
        assert torch.equal(ids.sort(1).values, want_ids.sort(1).values)
        t_torch = time_ms(lambda _: router_topk_reference(logits, 8)) * 1e3
        t_ours = time_ms(lambda _: router_topk_launch(logits, 8)) * 1e3
        print(f"rows {n}: torch softmax+topk {t_torch:.1f} us, router_topk {t_ours:.1f} us", flush=True)


if __name__ == "__main__":
    main()
