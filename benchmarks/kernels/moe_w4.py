"""Grouped W4A16 MoE layer vs HF's BF16 grouped_mm experts, one layer at the real 26B-A4B shape.

Rows are total token rows (canvas rows x batch). For each: ms (median, `_common.time_ms`, inputs rotated),
bytes moved, GB/s, fraction of the device copy bandwidth measured in this run, BF16 baseline ms, and
the W4 output checked against the dequantised torch twin in the same run.

GPU:  python benchmarks/kernels/moe_w4.py            (E=128 H=2816 I=704 K=8, bf16)
CPU:  python benchmarks/kernels/moe_w4.py --quick    (tiny shape, Triton interpreter, fp16)
Raw results go to $OUT/moe_w4.{json,md} when OUT is set; the last line printed is one JSON object.
"""

from __future__ import annotations

import argparse

import _common as C
import torch

from canvasq.kernels.moe import align_routing, get_config, pack_w4, w4_moe_launch, w4_moe_reference
from canvasq.kernels.moe.launch import launch_matmul
from canvasq.kernels.moe.quant import bf16_bytes, packed_bytes


def hf_experts(gate_up, down, impl: str):
    from transformers.models.diffusion_gemma.configuration_diffusion_gemma import DiffusionGemmaTextConfig
    from transformers.models.diffusion_gemma.modeling_diffusion_gemma import DiffusionGemmaTextExperts

    E, two_i, H = gate_up.shape
    cfg = DiffusionGemmaTextConfig(num_experts=E, hidden_size=H, moe_intermediate_size=two_i // 2)
    cfg._experts_implementation = impl
    with torch.device("meta"):
        mod = DiffusionGemmaTextExperts(cfg)
    mod.gate_up_proj = torch.nn.Parameter(gate_up, requires_grad=False)
    mod.down_proj = torch.nn.Parameter(down, requires_grad=False)
    return mod


def route(T: int, E: int, K: int, seed: int):
    g = torch.Generator(device=C.DEVICE).manual_seed(seed)
    logits = torch.randn(T, E, device=C.DEVICE, generator=g)
    w, ids = torch.topk(torch.softmax(logits, -1), K, dim=-1)
    return ids, (w / w.sum(-1, keepdim=True))


def moved_bytes(packed, ids, T, K, p_max, act_bytes: int) -> tuple[int, int]:
    """(W4 bytes, BF16 bytes) one call moves: touched experts' weights + activations in and out."""
    touched = int(torch.unique(ids).numel())
    H, I = packed.hidden, packed.inter
    act = T * H * act_bytes * 2 + T * K * H * act_bytes * 2  # x in, y out; y_tk written + read
    w4 = touched * packed.expert_nbytes() + act + p_max * I * act_bytes * 2  # + h written + read
    bf16 = touched * 3 * H * I * 2 + act + T * K * 2 * I * act_bytes * 2
    return w4, bf16


def graphed_ms(inputs, packed) -> float:
    """The whole w4_moe call (alignment + 3 kernels) replayed from CUDA graphs: GPU time without the
    ~15 Python/launch overheads that dominate an eager call at small row counts."""
    graphs = []
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for inp in inputs:  # warm (compile) outside capture
            w4_moe_launch(*inp, packed)
    torch.cuda.current_stream().wait_stream(stream)
    for inp in inputs:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            w4_moe_launch(*inp, packed)
        graphs.append(g)
    return C.time_ms(lambda i: graphs[i].replay(), rotate=len(graphs))


def measure(T: int, packed, E: int, K: int, dtype, bw: float, baseline) -> dict:
    """One row count: the W4 layer's error against its twin, its times (eager, graph, per kernel), bytes and
    fraction of `bw`, and the BF16 baseline's time when given."""
    H, I = packed.hidden, packed.inter
    inputs = [
        (torch.randn(T, H, device=C.DEVICE, dtype=dtype), *route(T, E, K, seed=T * 10 + i)) for i in range(3)
    ]
    x, ids, w = inputs[0]
    y = w4_moe_launch(x, ids, w, packed)
    ref = w4_moe_reference(x, ids, w, packed)
    err = ((y.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
    rerun_equal = torch.equal(y, w4_moe_launch(x, ids, w, packed))
    cfg = get_config(T, K, packed, dtype)
    meta = align_routing(ids, E, cfg.block_m)
    w4_b, bf_b = moved_bytes(packed, ids, T, K, meta.sorted_ids.numel(), x.element_size())

    ms = C.time_ms(lambda i: w4_moe_launch(*inputs[i], packed), rotate=3)
    graph_ms = graphed_ms(inputs, packed) if C.ON_GPU else None
    metas = [align_routing(inp[1], E, cfg.block_m) for inp in inputs]
    h = torch.empty(meta.sorted_ids.numel(), I, device=C.DEVICE, dtype=dtype)
    y_tk = torch.empty(T * K, H, device=C.DEVICE, dtype=dtype)
    ms_gu = C.time_ms(lambda i: launch_matmul("gate_up", inputs[i][0], packed, metas[i], cfg, h), rotate=3)
    ms_dn = C.time_ms(lambda i: launch_matmul("down", h, packed, metas[i], cfg, y_tk), rotate=3)
    ms_align = C.time_ms(lambda i: align_routing(inputs[i][1], E, cfg.block_m), rotate=3)
    row = {
        "rows": T,
        "w4_ms": ms,
        "graph_ms": graph_ms,
        "gate_up_ms": ms_gu,
        "down_ms": ms_dn,
        "align_ms": ms_align,
        "w4_MB": w4_b / 1e6,
        "w4_GBs": w4_b / ms / 1e6,
        "frac_bw": w4_b / ms / 1e6 / bw,
        "frac_bw_graph": w4_b / graph_ms / 1e6 / bw if graph_ms else None,
        "max_rel_err": err,
        "rerun_bit_equal": rerun_equal,
    }
    if baseline is not None:
        with torch.no_grad():
            yb = baseline(x, ids, w)
            row["w4_vs_bf16_rel_err"] = ((y.float() - yb.float()).norm() / yb.float().norm()).item()
            bms = C.time_ms(lambda i: baseline(*inputs[i]), rotate=3)
        row.update(bf16_ms=bms, bf16_GBs=bf_b / bms / 1e6, speedup=bms / ms)
    return row


COLS = [
    "rows",
    "w4_ms",
    "graph_ms",
    "frac_bw_graph",
    "gate_up_ms",
    "down_ms",
    "align_ms",
    "w4_MB",
    "w4_GBs",
    "frac_bw",
    "bf16_ms",
    "bf16_GBs",
    "speedup",
    "max_rel_err",
    "w4_vs_bf16_rel_err",
    "rerun_bit_equal",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny shape (CPU interpreter smoke test)")
    ap.add_argument("--rows", default="256,128,64,32,16,8")
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--no-baseline", action="store_true")
    a = ap.parse_args()

    if a.quick:
        E, H, I, K, dtype = 8, 256, 64, 4, torch.float16
        rows, batches = [6], [1]
    else:
        E, H, I, K, dtype = 128, 2816, 704, 8, torch.bfloat16
        rows = [int(r) for r in a.rows.split(",")]
        batches = [int(b) for b in a.batches.split(",")]
    totals = sorted({r * b for r in rows for b in batches}, reverse=True)
    torch.manual_seed(0)
    bw = C.measured_bandwidth_gbs(nbytes=(2 << 30) if C.ON_GPU else (8 << 20))
    gate_up = (torch.randn(E, 2 * I, H, device=C.DEVICE) * H**-0.5).to(dtype)
    down = (torch.randn(E, H, I, device=C.DEVICE) * I**-0.5).to(dtype)
    packed = pack_w4(gate_up, down)
    baseline, base_name = None, "none"
    if not a.no_baseline:
        base_name = "hf_grouped_mm_bf16" if C.ON_GPU else "hf_eager"
        baseline = hf_experts(gate_up, down, "grouped_mm" if C.ON_GPU else "eager")
    results = [measure(T, packed, E, K, dtype, bw, baseline) for T in totals]

    print(
        f"# W4A16 MoE layer, E={E} H={H} I={I} K={K} {dtype}, baseline {base_name}, "
        f"measured copy bandwidth {bw:.0f} GB/s (read + write)"
    )
    layers = 30
    summary = {
        **C.device_info(),
        "shape": {"E": E, "H": H, "I": I, "K": K},
        "dtype": str(dtype),
        "measured_bw_GBs": bw,
        "config_by_rows": {t: vars(get_config(t, K, packed, dtype)) for t in totals},
        "baseline": base_name,
        "packed_GiB_30_layers": packed_bytes(128, 2816, 704) * layers / 2**30,
        "bf16_GiB_30_layers": bf16_bytes(128, 2816, 704) * layers / 2**30,
        "correct": all(
            r["max_rel_err"] < (2e-2 if dtype == torch.bfloat16 else 3e-3) and r["rerun_bit_equal"]
            for r in results
        ),
        "rows": {
            r["rows"]: {"ms": r["w4_ms"], **{k: r[k] for k in ("graph_ms", "frac_bw", "frac_bw_graph")}}
            for r in results
        },
    }
    if results and not a.quick:
        r256 = next((r for r in results if r["rows"] == 256), max(results, key=lambda r: r["rows"]))
        summary["frac_bw_256_rows"] = r256["frac_bw"]
        summary["frac_bw_graph_256_rows"] = r256["frac_bw_graph"]
        summary["target_0.75_met"] = max(r256["frac_bw"], r256["frac_bw_graph"] or 0) >= 0.75
    C.report("moe_w4", results, COLS, summary)


if __name__ == "__main__":
    main()
