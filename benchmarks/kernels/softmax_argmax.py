"""Fused softmax confidence + argmax + entropy over the vocabulary vs the materialising PyTorch path
(softmax in fp32, max, entropy). Reports ms, GB/s over the logits read once, fraction of the measured
copy bandwidth; argmax checked for exact equality and confidence/entropy within 1e-3 in the same run.

GPU: python benchmarks/kernels/softmax_argmax.py   CPU: python benchmarks/kernels/softmax_argmax.py --quick
"""

from __future__ import annotations

import argparse

import _common as C
import torch

from canvasq.kernels.softmax_argmax import softmax_argmax_launch, softmax_argmax_reference


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    if a.quick:
        shapes, dtypes = [(4, 5000)], [torch.float32]
    else:
        shapes = [(r, 262144) for r in (8, 32, 128, 256, 1024)]
        dtypes = [torch.float32, torch.bfloat16]
    bw = C.measured_bandwidth_gbs(nbytes=(2 << 30) if C.ON_GPU else (8 << 20))
    rows = []
    for dtype in dtypes:
        for R, V in shapes:
            ls = [(torch.randn(R, V, device=C.DEVICE) * 4).to(dtype) for _ in range(2)]
            conf, arg, ent = softmax_argmax_launch(ls[0])
            c2, a2, e2 = softmax_argmax_reference(ls[0])
            ok = (
                torch.equal(arg, a2)
                and ((conf - c2).abs() / c2).max().item() < 1e-3
                and (ent - e2).abs().max().item() < 1e-3 * max(1.0, e2.abs().max().item())
            )
            ms = C.time_ms(lambda i, ls=ls: softmax_argmax_launch(ls[i]), rotate=2)
            ms_ref = C.time_ms(lambda i, ls=ls: softmax_argmax_reference(ls[i]), rotate=2)
            nbytes = R * V * ls[0].element_size()
            rows.append(
                {
                    "dtype": str(dtype).replace("torch.", ""),
                    "rows": R,
                    "V": V,
                    "ms": ms,
                    "torch_ms": ms_ref,
                    "speedup": ms_ref / ms,
                    "GBs": nbytes / ms / 1e6,
                    "frac_bw": nbytes / ms / 1e6 / bw,
                    "correct": ok,
                }
            )
    print(f"# softmax+argmax+entropy, measured copy bandwidth {bw:.0f} GB/s")
    C.report(
        "softmax_argmax",
        rows,
        ["dtype", "rows", "V", "ms", "torch_ms", "speedup", "GBs", "frac_bw", "correct"],
        {**C.device_info(), "measured_bw_GBs": bw, "correct": all(r["correct"] for r in rows)},
    )


if __name__ == "__main__":
    main()
