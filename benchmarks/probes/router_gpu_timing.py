"""GPU probe: the router's selection, torch (fp32 softmax, then torch.topk: three kernels on CUDA)
against `canvasq.kernels.router.router_topk` (one), at E = 128 experts, top-8, bf16 logits (random
normal * 2, torch seed 0). Timing: `benchmarks/kernels/_common.time_ms` (median). Outputs checked
first: the same probabilities (2e-6 relative) and the same set of experts per row.

    python benchmarks/probes/router_gpu_timing.py 8,256,1024,4096     # H200
    python benchmarks/probes/router_gpu_timing.py --quick             # CPU: interpreter, fp32, 8 rows
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "kernels"))
import _common as C  # first: on a machine without a GPU it makes the kernels interpreted
import torch

from canvasq.kernels.router import router_topk_launch, router_topk_reference


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("rows", nargs="?", default="256")
    ap.add_argument("--quick", action="store_true", help="8 rows (on CPU: interpreted, fp32)")
    a = ap.parse_args()
    dtype = torch.bfloat16 if C.ON_GPU else torch.float32  # the interpreter's bf16 loads are wrong
    torch.manual_seed(0)
    for n in [8] if a.quick else [int(v) for v in a.rows.split(",")]:
        logits = (torch.randn(n, 128, device=C.DEVICE) * 2).to(dtype)
        p, ids = router_topk_launch(logits, 8)
        want_p, want_ids = router_topk_reference(logits, 8)
        torch.testing.assert_close(p, want_p, rtol=2e-6, atol=1e-7)
        assert torch.equal(ids.sort(1).values, want_ids.sort(1).values)
        t_torch = C.time_ms(lambda _, x=logits: router_topk_reference(x, 8)) * 1e3
        t_ours = C.time_ms(lambda _, x=logits: router_topk_launch(x, 8)) * 1e3
        print(f"rows {n}: torch softmax+topk {t_torch:.1f} us, router_topk {t_ours:.1f} us", flush=True)


if __name__ == "__main__":
    main()
