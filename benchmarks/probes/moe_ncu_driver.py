"""Drive the default W4 MoE path for Nsight Compute (H200): a tiled pack of random-normal experts at the
real shape (E=128, H=2816, I=704, top-8, bf16, torch seed 0), the checked-in configs, `w4_moe_launch`
three times at T rows. `benchmarks/gpu_checks.sh ncu` profiles the second call's Gluon kernels:

    ncu --kernel-name regex:_gl_w4 --launch-skip 2 --launch-count 2 ... python benchmarks/probes/moe_ncu_driver.py 256
"""

import sys

import torch

from canvasq.kernels.moe import pack_w4, w4_moe_launch


def main():
    T = int(sys.argv[1]) if len(sys.argv) > 1 else 256
    E, H, I, K = 128, 2816, 704, 8
    torch.manual_seed(0)
    gate_up = (torch.randn(E, 2 * I, H, device="cuda") * H**-0.5).to(torch.bfloat16)
    down = (torch.randn(E, H, I, device="cuda") * I**-0.5).to(torch.bfloat16)
    packed = pack_w4(gate_up, down).to_tiled()
    del gate_up, down
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    ids = torch.topk(torch.randn(T, E, device="cuda"), K, -1).indices
    w = torch.rand(T, K, device="cuda").softmax(-1)
    for _ in range(3):
        w4_moe_launch(x, ids, w, packed)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
