"""Compile every canvasq Triton kernel for an H200 (sm_90) on any machine, no GPU needed, and print
registers, spill stack, shared memory and the number of async (cp.async) copies the pipeliner made.

Uses the ptxas/cuobjdump that ship with the Triton wheel. Kernels with a loop also report its size in
SASS instructions per iteration and its commonest opcodes (`loop_instr`, `loop_top`): the offline
measure used to work on the W4 MoE's dequantisation. Catches lowering errors before a GPU lease,
and flags tile configs that spill (a spilling W4 kernel cannot reach the bandwidth target).
Integer arguments get the divisibility-by-16 hint Triton gives them at launch when the real shapes
allow it (strides, H = 2816, I = 704).

    python benchmarks/kernels/compile_check.py              # default configs, real shape, bf16
    python benchmarks/kernels/compile_check.py --sweep      # the tune_moe candidates too
    python benchmarks/kernels/compile_check.py --only rms_norm_rope,qkv_norm_rope,add_rms_norm,pre_ffn_norms,gelu_mul
Exit status 1 when a default config spills, anything fails to compile, or a kernel that must round
where HF rounds (`norm_fused`) contains a half-precision FMA (`fma.rn.bf16` / `fma.rn.f16`: one
rounding where HF has two; tests/kernels/test_norm_fused.py runs this check in CI).
"""

from __future__ import annotations

import argparse
import collections
import importlib
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import replace

os.environ.pop("TRITON_INTERPRET", None)  # must compile, not interpret

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.experimental.gluon._runtime import GluonASTSource

from canvasq.kernels.moe.launch import (
    CONFIG_DIR,
    MoeLaunchConfig,
    _dequant_mode,
    _fold_zero,
    _load_configs,
    _sub_k,
    config_file_name,
)

# importlib: `canvasq.kernels.softmax_argmax` the attribute is the public function, not the module
R = importlib.import_module("canvasq.kernels.rmsnorm")
S = importlib.import_module("canvasq.kernels.softmax_argmax")
K = importlib.import_module("canvasq.kernels.moe.kernels")
NF = importlib.import_module("canvasq.kernels.norm_fused")
SC = importlib.import_module("canvasq.kernels.softcap")
GM = importlib.import_module("canvasq.kernels.gelu_mul")

TARGET = GPUTarget("cuda", 90, 32)
H200_CONFIGS = config_file_name(128, 2816, 704, 8, torch.bfloat16, "NVIDIA_H200")
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def compile_kernel(
    fn, types: dict, constexprs: dict, divisible: set, num_warps: int, num_stages: int, options=None
) -> dict:
    names = fn.arg_names
    if "PDL" in names and "PDL" not in constexprs:  # as launched on sm_90 (`_dispatch.pdl`)
        constexprs = {**constexprs, "PDL": True}
        options = {"launch_pdl": True, **(options or {})}
    sig = {n: ("constexpr" if n in constexprs else types[n]) for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in divisible}
    source = GluonASTSource if getattr(fn, "is_gluon", lambda: False)() else ASTSource
    k = triton.compile(
        source(fn, sig, constexprs, attrs),
        target=TARGET,
        options={"num_warps": num_warps, "num_stages": num_stages, **(options or {})},
    )
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        out = subprocess.run(
            [CUOBJDUMP, "-res-usage", f.name], capture_output=True, text=True, check=True
        ).stdout
        sass = subprocess.run([CUOBJDUMP, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    fields = dict(tok.split(":") for tok in next(ln for ln in out.splitlines() if "REG:" in ln).split()[:2])
    return {
        "regs": int(fields["REG"]),
        "stack": int(fields["STACK"]),
        "smem": k.metadata.shared,
        "async_copies": k.asm["ttgir"].count("async_copy_global_to_local"),
        "half_fma": k.asm["ptx"].count("fma.rn.bf16") + k.asm["ptx"].count("fma.rn.f16"),
        **loop_profile(sass),
    }


_SASS_LINE = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)(?:\.\S+)?\s*(.*);")


def loop_profile(sass: str) -> dict:
    """The largest loop of a kernel's SASS (the body of its longest backward branch): instructions per
    iteration and the six commonest opcodes, e.g. the W4 MoE's gate_up went 707 -> 472 when the
    nibbles moved to 32-bit words (BENCHMARKS.md, session 6). Empty for kernels without a loop."""
    instr = [
        (int(m.group(1), 16), m.group(2), m.group(3)) for m in map(_SASS_LINE.match, sass.splitlines()) if m
    ]
    best: list = []
    for addr, op, args in instr:
        target = re.search(r"0x([0-9a-f]+)", args) if op == "BRA" else None
        if target and int(target.group(1), 16) < addr:
            body = [o for a, o, _ in instr if int(target.group(1), 16) <= a <= addr]
            best = body if len(body) > len(best) else best
    if not best:
        return {}
    counts = collections.Counter(best)
    top = counts.most_common(6)
    return {
        "loop_instr": len(best),
        "loop_top": " ".join(f"{op}:{n}" for op, n in top),
        "loop_mma": counts["HMMA"] + counts["HGMMA"],
    }


def _ptrs(fn, dtype="bf16", overrides=None):
    t = {n: f"*{dtype}" for n in fn.arg_names if n.endswith("_ptr")}
    t.update(overrides or {})
    return t


def moe_kernels(cfg: MoeLaunchConfig, H=2816, I=704):
    deq = _dequant_mode(cfg, torch.bfloat16, compiled=True)  # the launcher's rule, bf16 on a GPU
    ints = {"num_assign": "i32", "top_k": "i32", "H": "i32", "I": "i32"}
    div = lambda fn: (
        {n for n in fn.arg_names if n.endswith("_ptr") or n.startswith("stride")} | {"H", "I", "num_assign"}
    )
    gu = K._w4_gate_up_kernel
    gu_types = {
        **_ptrs(
            gu,
            overrides={
                "q_ptr": "*u8",
                "sorted_ids_ptr": "*i32",
                "block_expert_ptr": "*i32",
                "num_padded_ptr": "*i32",
            },
        ),
        **ints,
        **{n: "i32" for n in gu.arg_names if n.startswith("stride")},
    }
    yield (
        "gate_up",
        compile_kernel(
            gu,
            gu_types,
            {
                "GROUP": 128,
                "NUM_GROUPS": H // 128,
                "BLOCK_M": cfg.block_m,
                "BLOCK_N": cfg.gate_up_block_n,
                "DOT_PREC": "tf32",
                "DEQUANT": deq,
                "SCALE_IN_TILE": cfg.scale_in_tile,
                "FOLD_ZERO": _fold_zero(cfg),
                "PREFETCH_SCALE": cfg.prefetch_scale,
                "SUB": _sub_k(cfg.gate_up_sub_k, 128),
                "EVEN_K": H % 128 == 0,
            },
            div(gu),
            cfg.gate_up_warps,
            cfg.gate_up_stages,
        ),
    )
    dn = K._w4_down_kernel
    dn_types = {
        **_ptrs(
            dn,
            overrides={
                "q_ptr": "*u8",
                "sorted_ids_ptr": "*i32",
                "block_expert_ptr": "*i32",
                "num_padded_ptr": "*i32",
            },
        ),
        **ints,
        **{n: "i32" for n in dn.arg_names if n.startswith("stride")},
    }
    yield (
        "down",
        compile_kernel(
            dn,
            dn_types,
            {
                "GROUP": 64,
                "NUM_GROUPS": I // 64,
                "BLOCK_M": cfg.block_m,
                "BLOCK_N": cfg.down_block_n,
                "DOT_PREC": "tf32",
                "DEQUANT": deq,
                "SCALE_IN_TILE": cfg.scale_in_tile,
                "FOLD_ZERO": _fold_zero(cfg),
                "PREFETCH_SCALE": cfg.prefetch_scale,
                "SUB": _sub_k(cfg.down_sub_k, 64),
                "EVEN_K": I % 64 == 0,
            },
            div(dn),
            cfg.down_warps,
            cfg.down_stages,
        ),
    )


GLUON_CONFIGS = os.path.join(CONFIG_DIR, H200_CONFIGS)
# checked-in tiles that spill and were measured fastest anyway (bytes of stack allowed): BLOCK_M 32 gate_up
# w2 t2 s3, 297 vs 336 us at 1024 rows and 956 vs 1075 at 4096 (probe 7cf24bd, BENCHMARKS.md session 8);
# down at 256 rows under a 72-register cap, 72.0 vs 78.2 us (probe c43a03e, session 9)
MEASURED_SPILLS = {
    "gluon_gate_up m32 w2 t2 s3": 48,
    "gluon_down m16 w4 t2 s3 r72": 8,
}


def gluon_kernels(path: str = GLUON_CONFIGS):
    """The Gluon MoE kernels (canvasq/kernels/moe/gluon_w4.py) at every distinct Gluon tile of the
    H200 configs (what a CUDA worker runs on its tiled packs): a layout that stops converting
    trivially (`assert_trivial`) fails here, on CPU."""
    G = importlib.import_module("canvasq.kernels.moe.gluon_w4")
    ptrs = {
        "qt_ptr": "*i32",
        "sz_ptr": "*i32",
        "sorted_ids_ptr": "*i32",
        "block_expert_ptr": "*i32",
        "num_padded_ptr": "*i32",
    }
    seen = set()
    for cfg in _load_configs(path).values():
        for which, group, groups in (("gate_up", 128, 22), ("down", 64, 11)):
            w, t, st, mr = (
                getattr(cfg, f"gluon_{which}_{k}") for k in ("warps", "tiles", "stages", "maxnreg")
            )
            bm = cfg.gluon_block_m or cfg.block_m
            key = (which, bm, w, t, st, mr)
            if key in seen:
                continue
            seen.add(key)
            fn = G._gl_w4_gate_up_kernel if which == "gate_up" else G._gl_w4_down_kernel
            types = {
                **_ptrs(fn, overrides=ptrs),
                **{n: "i32" for n in fn.arg_names if not n.endswith("_ptr")},
            }
            consts = {
                "GROUP": group,
                "NUM_GROUPS": groups,
                "BLOCK_M": bm,
                "BN": 16 * w * t,
                "NW": w,
                "STAGES": st,
            }
            div = {n for n in fn.arg_names if n.endswith("_ptr") or n.startswith("stride") or n == "I"}
            yield (
                f"gluon_{which} m{bm} w{w} t{t} s{st}" + (f" r{mr}" if mr else ""),
                compile_kernel(fn, types, consts, div, w, 1, options={"maxnreg": mr} if mr else None),
            )


def other_kernels():
    c = K._combine_kernel
    yield (
        "combine",
        compile_kernel(
            c,
            {
                **_ptrs(c, overrides={"w_ptr": "*fp32", "ids_ptr": "*i64"}),
                "H": "i32",
                "stride_ym": "i32",
                "stride_ot": "i32",
            },
            {"TOP_K": 8, "K_P2": 8, "RENORM": True, "BLOCK_N": 1024},
            {"y_tk_ptr", "out_ptr", "H", "stride_ym", "stride_ot"},
            4,
            1,
        ),
    )
    # routing chunks of 256 assignments (2,048 tokens) and of 2,048 (past 8,192 tokens): the chunk loop
    # once unrolled at the larger size compiled for minutes and spilled
    for chunk in (256, 2048):
        hk = K._histogram_kernel
        yield (
            f"histogram_chunk{chunk}",
            compile_kernel(
                hk,
                {"ids_ptr": "*i64", "hist_ptr": "*i32", "num_assign": "i32"},
                {"E_P2": 128, "CHUNK": chunk, "SUB": 32},
                set(),
                4,
                1,
            ),
        )
        a = K._align_kernel
        yield (
            f"align_chunk{chunk}",
            compile_kernel(
                a,
                {
                    "ids_ptr": "*i64",
                    "hist_ptr": "*i32",
                    "sorted_ids_ptr": "*i32",
                    "block_expert_ptr": "*i32",
                    "num_padded_ptr": "*i32",
                    "counts_ptr": "*i32",
                    "num_assign": "i32",
                    "num_experts": "i32",
                    "num_chunks": "i32",
                    "p_max": "i32",
                },
                {"BLOCK_M": 16, "E_P2": 128, "CHUNK": chunk, "SUB": 32, "HIST_ROWS": 16, "HIST_STEPS": 4},
                set(),
                4,
                1,
            ),
        )
    sc = SC._softcap_kernel
    yield (
        "softcap",
        compile_kernel(
            sc,
            {"x_ptr": "*bf16", "y_ptr": "*fp32", "n": "i32", "inv_cap": "fp32", "cap": "fp32"},
            {"BLOCK": 4096, "INTERPRETED": False},
            {"x_ptr", "y_ptr"},
            8,
            1,
            SC.NO_FP_FUSION,
        ),
    )
    r = R._rms_norm_kernel
    yield (
        "rms_norm",
        compile_kernel(
            r,
            {
                **_ptrs(r),
                "R": "i32",
                "D": "i32",
                "stride_x": "i32",
                "stride_y": "i32",
                "eps": "fp32",
            },
            {"HAS_WEIGHT": True, "BLOCK_R": 1, "BLOCK_D": 4096},
            {"x_ptr", "w_ptr", "y_ptr", "D", "stride_x", "stride_y"},
            8,
            1,
        ),
    )
    nr = NF._rms_norm_rope_kernel
    for half in (128, 256):  # sliding layers d = 256, full layers d = 512
        yield (
            f"rms_norm_rope_d{2 * half}",
            compile_kernel(
                nr,
                {
                    **_ptrs(nr),
                    "R": "i32",
                    "HEADS": "i32",
                    "stride_xn": "i32",
                    "stride_xh": "i32",
                    "stride_cn": "i32",
                    "stride_ya": "i32",
                    "stride_yh": "i32",
                    "stride_yb": "i32",
                    "eps": "fp32",
                },
                {
                    "HALF": half,
                    "HAS_WEIGHT": True,
                    "HAS_ROPE": True,
                    "SCATTER": True,
                    "BLOCK_R": 4096 // (2 * half),
                },
                {"x_ptr", "w_ptr", "cos_ptr", "sin_ptr", "y_ptr", "stride_xn", "stride_xh", "stride_cn"},
                4,
                1,
                NF.NO_FP_FUSION,
            ),
        )
    qn = NF._qkv_norm_rope_kernel
    for half in (128, 256):
        yield (
            f"qkv_norm_rope_d{2 * half}",
            compile_kernel(
                qn,
                {
                    **_ptrs(qn, overrides={n: "*i64" for n in qn.arg_names if n[1:] in ("a_ptr", "b_ptr")}),
                    **{n: "i32" for n in qn.arg_names if not n.endswith("_ptr") and n not in ("eps",)},
                    "eps": "fp32",
                },
                {"HALF": half, "BLOCK_R": 4096 // (2 * half)},
                {n for n in qn.arg_names if n.endswith("_ptr")},
                4,
                1,
                NF.NO_FP_FUSION,
            ),
        )
    at = importlib.import_module("canvasq.kernels.attention")
    for d in (256, 512):  # sliding and full layers
        bm, bn, warps, stages = at._tiles(d)
        yield (
            f"attend_d{d} m{bm} n{bn} w{warps} s{stages}",
            compile_kernel(
                at._attend_kernel,
                {
                    **_ptrs(at._attend_kernel, overrides={"slot_ptr": "*i64"}),
                    **{n: "i32" for n in at._attend_kernel.arg_names if not n.endswith("_ptr")},
                },
                {
                    "D": d,
                    "BLOCK_M": bm,
                    "BLOCK_N": bn,
                    "HAS_MASK": True,
                    "INTERPRET_STEPS": 0,
                    "DOT_PREC": "tf32",
                },
                {n for n in at._attend_kernel.arg_names if n.endswith("_ptr") or n.startswith("s")},
                warps,
                stages,
            ),
        )
    an = NF._add_rms_norm_kernel
    for combine in (False, True):  # the end of a layer: the experts' output combined, or their rows
        yield (
            "add_rms_norm" + ("_combine" if combine else ""),
            compile_kernel(
                an,
                {
                    **_ptrs(an, overrides={"rw_ptr": "*fp32", "ids_ptr": "*i64"}),
                    "R": "i32",
                    "D": "i32",
                    "stride_ym": "i32",
                    "eps": "fp32",
                },
                {
                    "HAS_X2": True,
                    "PRE_NORM": True,
                    "HAS_SCALE": True,
                    "BLOCK_R": 1,
                    "BLOCK_D": 4096,
                    "COMBINE": combine,
                    "TOP_K": 8,
                    "K_P2": 8,
                    "RENORM": True,
                },
                {"x_ptr", "x2_ptr", "w_ptr", "res_ptr", "y_ptr", "D", "stride_ym"},
                8,
                1,
                NF.NO_FP_FUSION,
            ),
        )
    pf = NF._pre_ffn_norms_kernel
    yield (
        "pre_ffn_norms",
        compile_kernel(
            pf,
            {**_ptrs(pf), "R": "i32", "D": "i32", "eps": "fp32", "scalar": "fp32"},
            {"BLOCK_R": 1, "BLOCK_D": 4096},
            {"x_ptr", "ya_ptr", "yr_ptr", "yb_ptr", "D"},
            8,
            1,
            NF.NO_FP_FUSION,
        ),
    )
    gm = GM._gelu_mul_kernel
    yield (
        "gelu_mul",
        compile_kernel(
            gm,
            {**_ptrs(gm), "R": "i32", "I": "i32", "stride_g": "i32", "k_beta": "fp32", "k_kappa": "fp32"},
            {"BLOCK_R": 2, "BLOCK_I": 1024, "INTERPRETED": False},
            {"gu_ptr", "y_ptr", "stride_g"},
            4,
            1,
        ),
    )
    p = S._softmax_stats_partial_kernel
    yield (
        "softmax_partial",
        compile_kernel(
            p,
            {
                "logits_ptr": "*bf16",
                "pm_ptr": "*fp32",
                "ps_ptr": "*fp32",
                "pu_ptr": "*fp32",
                "pi_ptr": "*i32",
                "V": "i32",
                "stride_r": "i32",
                "inv_temp": "fp32",
            },
            {"CHUNKS": 2, "CHUNK": 131072, "BLOCK_V": 2048},
            {"logits_ptr", "V", "stride_r"},
            8,
            1,
        ),
    )
    f = S._softmax_stats_final_kernel
    yield (
        "softmax_final",
        compile_kernel(
            f,
            {
                "pm_ptr": "*fp32",
                "ps_ptr": "*fp32",
                "pu_ptr": "*fp32",
                "pi_ptr": "*i32",
                "conf_ptr": "*fp32",
                "arg_ptr": "*i64",
                "ent_ptr": "*fp32",
            },
            {"CHUNKS": 2},
            set(),
            1,
            1,
        ),
    )


ROUNDING_FAITHFUL = (
    "rms_norm_rope",
    "qkv_norm_rope",
    "add_rms_norm",
    "pre_ffn_norms",
    "gelu_mul",
)  # must keep HF's roundings


def _only(prefixes: tuple[str, ...]):
    """The kernels whose names start with one of `prefixes` (the MoE kernels are compiled only if asked)."""
    moe = moe_kernels(MoeLaunchConfig()) if any(p in ("gate_up", "down") for p in prefixes) else ()
    gl = gluon_kernels() if any(p.startswith("gluon") for p in prefixes) else ()
    return ((n, r) for n, r in itertools.chain(moe, gl, other_kernels()) if n.startswith(prefixes))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sweep", action="store_true", help="also compile the tune_moe candidate tiles")
    ap.add_argument("--only", default="", help="comma list of kernel-name prefixes (default: all)")
    ap.add_argument(
        "--sub-k",
        default="",
        help="comma list of packed rows per MoE iteration to compile at the tuned 256-row tiles (none = half a"
        " group, e.g. none,32,16)",
    )
    a = ap.parse_args()
    rows, failed = [], False
    only = tuple(x for x in a.only.split(",") if x)
    for name, res in (
        _only(only)
        if only
        else itertools.chain(moe_kernels(MoeLaunchConfig()), gluon_kernels(), other_kernels())
    ):
        rows.append({"kernel": name, "config": "default", **res})
        spill_ok = MEASURED_SPILLS.get(name, 0)
        failed |= res["stack"] > spill_ok or (name.startswith(ROUNDING_FAITHFUL) and res["half_fma"] > 0)
    tuned = _load_configs(str(CONFIG_DIR / H200_CONFIGS))[256]  # the checked-in tiles at 256 rows
    for sub in (None if v == "none" else int(v) for v in a.sub_k.split(",") if v):
        # down's half group is 32 rows
        cfg = replace(tuned, gate_up_sub_k=sub, down_sub_k=None if sub is None else min(sub, 32))
        for name, res in moe_kernels(cfg):
            rows.append(
                {
                    "kernel": name,
                    "config": f"tuned-256 sub_k={cfg.gate_up_sub_k if name == 'gate_up' else cfg.down_sub_k}",
                    **res,
                }
            )
    if a.sweep:
        for bn, w, st, sit in itertools.product((32, 64, 128), (4, 8), (2, 3, 4), (False, True)):
            cfg = MoeLaunchConfig(
                gate_up_block_n=bn,
                gate_up_warps=w,
                gate_up_stages=st,
                down_block_n=2 * bn,
                down_warps=w,
                down_stages=st,
                scale_in_tile=sit,
            )
            try:
                for name, res in moe_kernels(cfg):
                    bn_k = bn if name == "gate_up" else 2 * bn
                    rows.append(
                        {"kernel": name, "config": f"bn={bn_k} w={w} s={st} scale_in_tile={sit}", **res}
                    )
            except Exception as exc:  # noqa: BLE001 - report any lowering failure of a candidate
                rows.append({"kernel": "?", "config": f"bn={bn} w={w} s={st}", "error": type(exc).__name__})
    for r in rows:
        print(r)
    print(json.dumps({"bench": "compile_check", "target": "sm_90", "ok": not failed, "kernels": len(rows)}))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
