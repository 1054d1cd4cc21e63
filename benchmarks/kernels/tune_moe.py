"""Tune the W4 MoE launch configs for one shape on this device; writes the checked-in JSON that
`canvasq.kernels.moe.config.get_config` reads (keyed by shape, dtype and device name).

GPU:  python benchmarks/kernels/tune_moe.py                 (real shape, rows 8..4096)
CPU:  python benchmarks/kernels/tune_moe.py --quick --dry   (interpreter smoke test, writes nothing
                                                             unless --out is given)
The gate_up and down kernels are tuned separately for each BLOCK_M (they are independent given the
routing), each candidate checked against the first for correctness before it may win.
This tunes the Triton kernels (K-contiguous packs). The Gluon tiles in the same file (what a CUDA
worker runs on its tiled packs) are kept from the file this one replaces, and are re-chosen by
benchmarks/probes/moe_gluon_gpu_timing.py, which starts from this file's configs.
"""

from __future__ import annotations

import argparse
import itertools
import os
from dataclasses import fields, replace
from functools import partial
from pathlib import Path

import _common as C
import torch
from triton.compiler.errors import CompilationError
from triton.runtime.errors import OutOfResources

from canvasq.kernels.moe import MoeLaunchConfig, align_routing, pack_w4
from canvasq.kernels.moe.config import CONFIG_DIR, config_file_name, device_name, load_configs, save_configs
from canvasq.kernels.moe.launch import launch_matmul

# a tile too big for shared memory or registers fails at compile or launch; the tuner skips it
TUNE_ERRORS = (OutOfResources, CompilationError, RuntimeError)


def keep_gluon_tiles(
    best: dict[int, MoeLaunchConfig], previous: dict[int, MoeLaunchConfig]
) -> dict[int, MoeLaunchConfig]:
    """The tuned Triton tiles with the Gluon tiles of the previous file's entry for the same rows."""
    gluon = [f.name for f in fields(MoeLaunchConfig) if f.name.startswith("gluon_")]
    return {
        t: replace(c, **{k: getattr(previous[t], k) for k in gluon}) if t in previous else c
        for t, c in best.items()
    }


def _time_gate_up(x, packed, metas, h, h_ref, P, cfg):
    launch_matmul("gate_up", x[0], packed, metas[0], cfg, h[0])
    if not torch.allclose(h[0][:P].float(), h_ref[:P].float(), rtol=2e-2, atol=2e-2):
        return float("inf")
    return C.time_ms(lambda i: launch_matmul("gate_up", x[i], packed, metas[i], cfg, h[i]), rotate=3)


def _time_down(h, h_ref, packed, metas, y, y_ref, cfg):
    launch_matmul("down", h_ref, packed, metas[0], cfg, y)
    if not torch.allclose(y.float(), y_ref.float(), rtol=2e-2, atol=2e-2):
        return float("inf")
    return C.time_ms(lambda i: launch_matmul("down", h[i], packed, metas[i], cfg, y), rotate=3)


def candidates(quick: bool, gate_up_n=(32, 64, 128), down_n=(64, 128, 256)):
    """(block_m list, gate_up (BLOCK_N, warps, stages) list, down list). Sized to compile in a few
    minutes (one compile per candidate, ~3 s each)."""
    if quick:
        return [32], [(32, 4, 2), (64, 4, 2)], [(64, 4, 2), (128, 4, 2)]
    gate_up = list(itertools.product(gate_up_n, (4, 8), (3, 4)))
    down = list(itertools.product(down_n, (4, 8), (3, 4)))
    return [32], gate_up, down


def _fastest(cands, time_fn, make_cfg, log: list, label: str) -> tuple[float, MoeLaunchConfig]:
    """(ms, config) of the fastest candidate; tiles that do not fit (shared memory, registers) are logged."""
    results = []
    for cand in cands:
        cfg = make_cfg(*cand)
        try:
            results.append((time_fn(cfg), cfg))
        except TUNE_ERRORS as exc:
            log.append(f"{label} {cfg}: {type(exc).__name__}")
    return min(results, key=lambda r: r[0])


def tune_block(
    packed, x: list, ids: list, bm: int, gu_cands, dn_cands, log: list
) -> tuple[float, MoeLaunchConfig]:
    """The fastest gate_up tiles, then the fastest down tiles on top, at routing block `bm`: (ms, config).
    x: rotated activations [T, H]; ids: their top-k expert ids [T, K]."""
    (T, H), K, E, I, dtype = x[0].shape, ids[0].shape[1], packed.num_experts, packed.inter, x[0].dtype
    metas = [align_routing(i, E, bm) for i in ids]
    p_max = metas[0].sorted_ids.numel()
    h = [torch.empty(p_max, I, device=C.DEVICE, dtype=dtype) for _ in range(3)]
    y = torch.empty(T * K, H, device=C.DEVICE, dtype=dtype)
    base = MoeLaunchConfig(block_m=bm)
    # reference outputs of the default tiles, to reject a candidate that computes garbage
    launch_matmul("gate_up", x[0], packed, metas[0], base, h[0])
    P = int(metas[0].num_padded.item())  # rows past P are never written: compare only [:P]
    h_ref = h[0].clone()
    launch_matmul("down", h_ref, packed, metas[0], base, y)
    y_ref = y.clone()
    time_gu = partial(_time_gate_up, x, packed, metas, h, h_ref, P)
    time_dn = partial(_time_down, h, h_ref, packed, metas, y, y_ref)
    label = f"T={T} BLOCK_M={bm}"
    gu_ms, gu_cfg = _fastest(
        gu_cands, time_gu, lambda bn, w, st: replace(base, gate_up_block_n=bn, gate_up_warps=w, gate_up_stages=st),
        log, label,
    )  # fmt: skip
    dn_ms, dn_cfg = _fastest(
        dn_cands, time_dn, lambda bn, w, st: replace(gu_cfg, down_block_n=bn, down_warps=w, down_stages=st),
        log, label,
    )  # fmt: skip
    print(f"{label}: gate_up {gu_ms:.4f} ms, down {dn_ms:.4f} ms", flush=True)
    return gu_ms + dn_ms, dn_cfg


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--dry", action="store_true", help="print, do not write the JSON")
    ap.add_argument("--rows", default="8,16,32,64,128,256,512,1024,2048,4096")
    ap.add_argument("--block-m", default=None, help="comma list of routing block sizes; default 32")
    ap.add_argument("--out", default=None, help="JSON path (default: the package's configs/ file)")
    ap.add_argument("--gate-up-n", default="32,64,128", help="gate_up BLOCK_N candidates")
    ap.add_argument("--down-n", default="64,128,256", help="down BLOCK_N candidates")
    a = ap.parse_args()
    if a.quick:
        E, H, I, K, dtype, rows = 8, 256, 64, 4, torch.float16, [6]
    else:
        E, H, I, K, dtype = 128, 2816, 704, 8, torch.bfloat16
        rows = [int(r) for r in a.rows.split(",")]
    ints = lambda v: tuple(int(x) for x in v.split(","))
    block_ms, gu_cands, dn_cands = candidates(a.quick, ints(a.gate_up_n), ints(a.down_n))
    if a.block_m:
        block_ms = [int(b) for b in a.block_m.split(",")]
    torch.manual_seed(0)
    gate_up = (torch.randn(E, 2 * I, H, device=C.DEVICE) * H**-0.5).to(dtype)
    down = (torch.randn(E, H, I, device=C.DEVICE) * I**-0.5).to(dtype)
    packed = pack_w4(gate_up, down)
    del gate_up, down

    best: dict[int, MoeLaunchConfig] = {}
    log = []
    for T in rows:
        x = [torch.randn(T, H, device=C.DEVICE, dtype=dtype) for _ in range(3)]
        ids = [torch.topk(torch.randn(T, E, device=C.DEVICE), K, -1).indices for _ in range(3)]
        tuned = [tune_block(packed, x, ids, bm, gu_cands, dn_cands, log) for bm in block_ms]
        ms, best[T] = min(tuned, key=lambda r: r[0])
        print(f"T={T}: best {ms:.4f} ms {best[T]}")

    name = config_file_name(E, H, I, K, dtype, device_name(packed.device))
    path = Path(a.out) if a.out else CONFIG_DIR / name
    meta = {**C.device_info(), "shape": {"E": E, "H": H, "I": I, "K": K}, "dtype": str(dtype), "file": name}
    best = keep_gluon_tiles(best, load_configs(str(CONFIG_DIR / name)))
    if not a.dry or a.out:
        save_configs(path, best, meta)
        print(f"wrote {path}")
    if os.environ.get("OUT"):  # the GPU lease returns only $OUT: keep a copy there to check in
        (Path(os.environ["OUT"]) / "configs").mkdir(parents=True, exist_ok=True)
        save_configs(Path(os.environ["OUT"]) / "configs" / name, best, meta)
    for line in log[:20]:
        print("skipped:", line)
    cols = ["rows", "block_m", "gate_up_block_n", "gate_up_warps", "gate_up_stages", "down_block_n"]
    cols += ["down_warps", "down_stages"]
    rows_out = [{"rows": t, **vars(c)} for t, c in best.items()]
    C.report("tune_moe", rows_out, cols, {"file": str(path), "written": not a.dry or bool(a.out)})


if __name__ == "__main__":
    main()
