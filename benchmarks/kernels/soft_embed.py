"""Self-conditioning's top-k expected embedding: the Triton bag (`kernels/soft_embed.py`) against
torch's weighted `F.embedding_bag`, at the real shape (64 / 16 windows of 256 rows, k = 64, the
262,144 x 2,816 bf16 table). Reports ms, GB/s of the k table rows read, and the outputs' difference.
A worker picks the bag with `Runtime.sc_bag` (`official_service.py` arm `official@sc_bag=triton`).

GPU: python benchmarks/kernels/soft_embed.py      CPU: python benchmarks/kernels/soft_embed.py --quick
"""

from __future__ import annotations

import argparse

import _common as C
import torch

from canvasq.kernels.soft_embed import soft_embed_launch, soft_embed_reference


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    if a.quick:
        dtype, vocab, width, k, batches = torch.float16, 500, 300, 64, [2]
    else:
        dtype, vocab, width, k, batches = torch.bfloat16, 262144, 2816, 64, [64, 16]
    table = torch.randn(vocab, width, device=C.DEVICE).to(dtype)
    rows = []
    for b in batches:
        R = b * (256 if not a.quick else 4)
        ids = [torch.randint(0, vocab, (R, k), device=C.DEVICE) for _ in range(2)]
        p = [torch.softmax(torch.randn(R, k, device=C.DEVICE) * 4, dim=-1).to(dtype) for _ in range(2)]
        out = soft_embed_launch(ids[0], p[0], table)
        ref = soft_embed_reference(ids[0], p[0], table)
        err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
        ms = C.time_ms(lambda i, ids=ids, p=p: soft_embed_launch(ids[i], p[i], table), rotate=2)
        ms_ref = C.time_ms(lambda i, ids=ids, p=p: soft_embed_reference(ids[i], p[i], table), rotate=2)
        nbytes = R * k * width * table.element_size()
        rows.append(
            {
                "rows": R,
                "k": k,
                "ms": ms,
                "torch_ms": ms_ref,
                "speedup": ms_ref / ms,
                "GBs": nbytes / ms / 1e6,
                "max_rel_err": err,
            }
        )
    tol = 1.6e-2 if dtype == torch.bfloat16 else 2e-3
    C.report(
        "soft_embed",
        rows,
        ["rows", "k", "ms", "torch_ms", "speedup", "GBs", "max_rel_err"],
        {**C.device_info(), "correct": all(r["max_rel_err"] < tol for r in rows)},
    )


if __name__ == "__main__":
    main()
