"""Drive the default W4 MoE path for Nsight Compute (H200): a tiled pack of random-normal experts at the
real shape (E=128, H=2816, I=704, top-8, bf16, torch seed 0), the checked-in configs, `w4_moe_launch`
three times at T rows. `benchmarks/gpu_checks.sh ncu` profiles the second call's Gluon kernels:

    ncu --kernel-name regex:_gl_w4 --launch-skip 2 --launch-count 2 ... python benchmarks/probes/moe_ncu_driver.py 256
    python benchmarks/probes/moe_ncu_driver.py --quick    # a tiny shape (on CPU: interpreted, fp16)
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "kernels"))
import _common as C  # first: on a machine without a GPU it makes the kernels interpreted
import torch

from canvasq.kernels.moe import pack_w4, w4_moe_launch, w4_moe_reference
from canvasq.kernels.moe.launch import prefer_tiled


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("rows", nargs="?", type=int, default=256)
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    (E, H, I, K), T = ((8, 256, 128, 4), 8) if a.quick else ((128, 2816, 704, 8), a.rows)
    dtype = torch.bfloat16 if C.ON_GPU else torch.float16  # the interpreter's bf16 loads are wrong
    torch.manual_seed(0)
    gate_up = (torch.randn(E, 2 * I, H, device=C.DEVICE) * H**-0.5).to(dtype)
    down = (torch.randn(E, H, I, device=C.DEVICE) * I**-0.5).to(dtype)
    packed = prefer_tiled(pack_w4(gate_up, down))  # tiled (the Gluon kernels) wherever they can run
    del gate_up, down
    x = torch.randn(T, H, device=C.DEVICE, dtype=dtype)
    ids = torch.topk(torch.randn(T, E, device=C.DEVICE), K, -1).indices
    w = torch.rand(T, K, device=C.DEVICE).softmax(-1)
    for _ in range(3):
        y = w4_moe_launch(x, ids, w, packed)
    C.sync()
    ref = w4_moe_reference(x, ids, w, packed)
    err = float((y.float() - ref.float()).abs().max() / ref.float().abs().max())
    print(f"rows {T}, {'Gluon (tiled)' if packed.tiled else 'Triton'} kernels, rel. error vs twin {err:.2e}")
    assert err < 2e-2


if __name__ == "__main__":
    main()
