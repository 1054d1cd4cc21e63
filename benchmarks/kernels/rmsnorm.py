"""Fused RMSNorm vs the HF/PyTorch formula at DiffusionGemma shapes (hidden 2816; q/k norms over
head_dim 256 and 512 rows x heads). Reports ms, GB/s (x read + y written + weight), fraction of the
measured copy bandwidth; output checked against the twin in the same run.

GPU: python benchmarks/kernels/rmsnorm.py      CPU: python benchmarks/kernels/rmsnorm.py --quick
"""

from __future__ import annotations

import argparse

import _common as C
import torch

from canvasq.kernels.rmsnorm import rms_norm_launch, rms_norm_reference


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    if a.quick:
        shapes, dtype = [(8, 256), (4 * 2, 64)], torch.float16
    else:
        dtype = torch.bfloat16
        shapes = [(r, 2816) for r in (8, 32, 256, 1024, 4096)] + [(256 * 16, 256), (256 * 2, 512)]
    bw = C.measured_bandwidth_gbs(nbytes=(2 << 30) if C.ON_GPU else (8 << 20))
    rows = []
    for R, D in shapes:
        xs = [torch.randn(R, D, device=C.DEVICE, dtype=dtype) for _ in range(3)]
        w = torch.randn(D, device=C.DEVICE, dtype=dtype)
        y = rms_norm_launch(xs[0], w, 1e-6)
        ref = rms_norm_reference(xs[0], w)
        err = ((y.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
        ms = C.time_ms(lambda i, xs=xs, w=w: rms_norm_launch(xs[i], w, 1e-6), rotate=3)
        ms_ref = C.time_ms(lambda i, xs=xs, w=w: rms_norm_reference(xs[i], w), rotate=3)
        nbytes = 2 * R * D * xs[0].element_size() + D * w.element_size()
        rows.append(
            {
                "rows": R,
                "D": D,
                "ms": ms,
                "torch_ms": ms_ref,
                "speedup": ms_ref / ms,
                "GBs": nbytes / ms / 1e6,
                "frac_bw": nbytes / ms / 1e6 / bw,
                "max_rel_err": err,
            }
        )
    print(f"# RMSNorm {dtype}, measured copy bandwidth {bw:.0f} GB/s")
    tol = 1.6e-2 if dtype == torch.bfloat16 else 2e-3
    C.report(
        "rmsnorm",
        rows,
        ["rows", "D", "ms", "torch_ms", "speedup", "GBs", "frac_bw", "max_rel_err"],
        {**C.device_info(), "measured_bw_GBs": bw, "correct": all(r["max_rel_err"] < tol for r in rows)},
    )


if __name__ == "__main__":
    main()
