"""Tune the W4 MoE launch configs for one shape on this device; writes the checked-in JSON that
`canvasq.kernels.moe.launch.get_config` reads (keyed by shape, dtype and device name).

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
from canvasq.kernels.moe.launch import (
    CONFIG_DIR,
    _device_name,
    _load_configs,
    config_file_name,
    launch_down,
    launch_gate_up,
    save_configs,
)

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


def _time_gate_up(x, packed, metas, h, h_ref, P, iters, cfg):
    launch_gate_up(x[0], packed, metas[0], cfg, h[0])
    if not torch.allclose(h[0][:P].float(), h_ref[:P].float(), rtol=2e-2, atol=2e-2):
        return float("inf")
    return C.time_ms(lambda i: launch_gate_up(x[i], packed, metas[i], cfg, h[i]), iters, 3, 3)


def _time_down(h, h_ref, packed, metas, y, y_ref, iters, cfg):
    launch_down(h_ref, packed, metas[0], cfg, y)
    if not torch.allclose(y.float(), y_ref.float(), rtol=2e-2, atol=2e-2):
        return float("inf")
    return C.time_ms(lambda i: launch_down(h[i], packed, metas[i], cfg, y), iters, 3, 3)


# dequantisation modes: name -> (scale_in_tile, fold_zero, prefetch_scale)
MODES = {
    "plain": (False, False, False),
    "scaled": (True, False, False),
    "folded": (False, True, False),
    "prefetch": (False, False, True),
    "scaled_prefetch": (True, False, True),
}


def candidates(quick: bool, gate_up_n=(32, 64, 128), down_n=(64, 128, 256), sub_k=(None,)):
    """(block_m list, mode names, gate_up (BLOCK_N, warps, stages, sub_k) list, down list).
    Sized to compile in a few minutes (one compile per candidate, ~3 s each); each extra sub_k
    multiplies the candidates (down takes the values ≤ its half group of 32)."""
    if quick:
        return (
            [32],
            ["plain", "folded"],
            [(32, 4, 2, None), (64, 4, 2, 16)],
            [(64, 4, 2, None), (128, 4, 2, 16)],
        )
    gate_up = list(itertools.product(gate_up_n, (4, 8), (3, 4), sub_k))
    down = list(itertools.product(down_n, (4, 8), (3, 4), [k for k in sub_k if k is None or k <= 32]))
    return [32], list(MODES), gate_up, down


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--dry", action="store_true", help="print, do not write the JSON")
    ap.add_argument("--rows", default="8,16,32,64,128,256,512,1024,2048,4096")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--block-m", default=None, help="comma list of routing block sizes; default 32")
    ap.add_argument("--out", default=None, help="JSON path (default: the package's configs/ file)")
    ap.add_argument("--modes", default=None, help=f"comma list of {', '.join(MODES)} (default: all)")
    ap.add_argument("--gate-up-n", default="32,64,128", help="gate_up BLOCK_N candidates")
    ap.add_argument("--down-n", default="64,128,256", help="down BLOCK_N candidates")
    ap.add_argument(
        "--sub-k",
        default="none",
        help="packed rows per iteration candidates, e.g. none,32,16 (none: half a group)",
    )
    a = ap.parse_args()
    if a.quick:
        E, H, I, K, dtype, rows, iters = 8, 256, 64, 4, torch.float16, [6], 1
    else:
        E, H, I, K, dtype = 128, 2816, 704, 8, torch.bfloat16
        rows, iters = [int(r) for r in a.rows.split(",")], a.iters
    ints = lambda v: tuple(int(x) for x in v.split(","))
    subs = tuple(None if v == "none" else int(v) for v in a.sub_k.split(","))
    block_ms, modes, gu_cands, dn_cands = candidates(a.quick, ints(a.gate_up_n), ints(a.down_n), subs)
    if a.block_m:
        block_ms = [int(b) for b in a.block_m.split(",")]
    if a.modes:
        modes = a.modes.split(",")
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
        overall = None
        for bm, mode in itertools.product(block_ms, modes):
            sit, fold, pre = MODES[mode]
            metas = [align_routing(i, E, bm) for i in ids]
            p_max = metas[0].sorted_ids.numel()
            h = [torch.empty(p_max, I, device=C.DEVICE, dtype=dtype) for _ in range(3)]
            y = torch.empty(T * K, H, device=C.DEVICE, dtype=dtype)
            base = MoeLaunchConfig(block_m=bm, scale_in_tile=sit, fold_zero=fold, prefetch_scale=pre)
            # reference outputs of the default tiles, to reject a candidate that computes garbage
            launch_gate_up(x[0], packed, metas[0], base, h[0])
            P = int(metas[0].num_padded.item())  # rows past P are never written: compare only [:P]
            h_ref = h[0].clone()
            launch_down(h_ref, packed, metas[0], base, y)
            y_ref = y.clone()
            time_gu = partial(_time_gate_up, x, packed, metas, h, h_ref, P, iters)
            time_dn = partial(_time_down, h, h_ref, packed, metas, y, y_ref, iters)

            gu_results = []
            for bn, w, st, sub in gu_cands:
                cfg = replace(base, gate_up_block_n=bn, gate_up_warps=w, gate_up_stages=st, gate_up_sub_k=sub)
                try:
                    gu_results.append((time_gu(cfg), cfg))
                except TUNE_ERRORS as exc:  # out of shared memory / registers for this tile: skip
                    log.append(f"T={T} {cfg}: {type(exc).__name__}")
            gu_ms, gu_cfg = min(gu_results, key=lambda r: r[0])
            dn_results = []
            for bn, w, st, sub in dn_cands:
                cfg = replace(gu_cfg, down_block_n=bn, down_warps=w, down_stages=st, down_sub_k=sub)
                try:
                    dn_results.append((time_dn(cfg), cfg))
                except TUNE_ERRORS as exc:
                    log.append(f"T={T} {cfg}: {type(exc).__name__}")
            dn_ms, dn_cfg = min(dn_results, key=lambda r: r[0])
            total = gu_ms + dn_ms
            print(
                f"T={T} BLOCK_M={bm} mode={mode}: gate_up {gu_ms:.4f} ms, down {dn_ms:.4f} ms",
                flush=True,
            )
            if overall is None or total < overall[0]:
                overall = (total, dn_cfg)
        best[T] = overall[1]
        print(f"T={T}: best {overall[0]:.4f} ms {overall[1]}")

    name = config_file_name(E, H, I, K, dtype, _device_name(packed.device))
    path = Path(a.out) if a.out else CONFIG_DIR / name
    meta = {**C.device_info(), "shape": {"E": E, "H": H, "I": I, "K": K}, "dtype": str(dtype), "file": name}
    best = keep_gluon_tiles(best, _load_configs(str(CONFIG_DIR / name)))
    if not a.dry or a.out:
        save_configs(path, best, meta)
        print(f"wrote {path}")
    if os.environ.get("OUT"):  # the GPU lease returns only $OUT: keep a copy there to check in
        (Path(os.environ["OUT"]) / "configs").mkdir(parents=True, exist_ok=True)
        save_configs(Path(os.environ["OUT"]) / "configs" / name, best, meta)
    for line in log[:20]:
        print("skipped:", line)
    C.report(
        "tune_moe",
        [{"rows": t, **vars(c)} for t, c in best.items()],
        [
            "rows",
            "block_m",
            "gate_up_block_n",
            "gate_up_warps",
            "gate_up_stages",
            "down_block_n",
            "down_warps",
            "down_stages",
            "magic_dequant",
            "scale_in_tile",
            "fold_zero",
            "prefetch_scale",
            "gate_up_sub_k",
            "down_sub_k",
        ],
        {"file": str(path), "written": not a.dry or bool(a.out)},
    )


if __name__ == "__main__":
    main()
