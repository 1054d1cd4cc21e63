"""Compile every canvasq Triton/Gluon kernel for an H200 (sm_90) on any machine, no GPU needed, and print
registers, spill stack, shared memory and the number of async (cp.async) copies the pipeliner made.

Each kernel module says how its kernels are launched at the real shape (`compile_specs()`, beside the
kernels; `canvasq.kernels.compile_spec.CompileSpec`). Uses the ptxas/cuobjdump that ship with the
Triton wheel. Kernels with a loop also report its size in SASS instructions per iteration and its
commonest opcodes (`loop_instr`, `loop_top`): the offline measure of the W4 MoE's dequantisation cost.
Catches lowering errors before a GPU lease, and flags tile configs that spill (a spilling W4 kernel
cannot reach the bandwidth target).

    python benchmarks/kernels/compile_check.py              # every kernel, real shape, bf16
    python benchmarks/kernels/compile_check.py --sweep      # the tune_moe candidates too
    python benchmarks/kernels/compile_check.py --only rms_norm_rope,qkv_norm_rope,add_rms_norm,pre_ffn_norms,gelu_mul
Exit status 1 when a kernel spills more than its spec allows, anything fails to compile, or a kernel
that must round where HF rounds (`rounds_like_hf`) contains a half-precision FMA (`fma.rn.bf16` /
`fma.rn.f16`: one rounding where HF has two; tests/kernels/test_norm_fused.py runs this check in CI).
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

os.environ.pop("TRITON_INTERPRET", None)  # must compile, not interpret

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.experimental.gluon._runtime import GluonASTSource

from canvasq.kernels.compile_spec import CompileSpec
from canvasq.kernels.moe.config import MoeLaunchConfig

# the modules whose `compile_specs()` this compiles (attribute names can shadow modules: import by path)
MODULES = (
    "moe.kernels",
    "moe.gluon_w4",
    "softcap",
    "rmsnorm",
    "norm_rope",
    "norm_residual",
    "attention",
    "viterbi",
    "gelu_mul",
    "fp8_quant",
    "fp8_grouped",
    "moe.w4a8",
    "moe.gluon_w4a8",
    "softmax_argmax",
    "softmax_invcdf",
    "softmax_topk",
    "router",
    "soft_embed",
    "pin",
    "rules",
    "constrain",
    "expert_order",
)
TARGET = GPUTarget("cuda", 90, 32)
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def compile_kernel(spec: CompileSpec) -> dict:
    names = spec.fn.arg_names
    constexprs, options = spec.constexprs, dict(spec.options)
    if "PDL" in names and "PDL" not in constexprs:  # as launched on sm_90 (`_dispatch.pdl`)
        constexprs = {**constexprs, "PDL": True}
        options = {"launch_pdl": True, **options}
    types = spec.arg_types()
    sig = {n: ("constexpr" if n in constexprs else types[n]) for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in spec.divisible}
    source = GluonASTSource if getattr(spec.fn, "is_gluon", lambda: False)() else ASTSource
    k = triton.compile(
        source(spec.fn, sig, constexprs, attrs),
        target=TARGET,
        options={"num_warps": spec.num_warps, "num_stages": spec.num_stages, **options},
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
    iteration and the six commonest opcodes (the W4 MoE's: its dequantisation's cost in instructions).
    Empty for kernels without a loop."""
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
        "loop_mma": counts["HMMA"] + counts["HGMMA"] + counts["QGMMA"],
    }


def all_specs():
    for m in MODULES:
        yield from importlib.import_module(f"canvasq.kernels.{m}").compile_specs()


def check(spec: CompileSpec) -> tuple[dict, bool]:
    """(the compile's report, whether it breaks the spec: spills past its allowance, or a half-precision
    FMA in a kernel that must round like HF)."""
    res = compile_kernel(spec)
    return res, res["stack"] > spec.spill_bytes or (spec.rounds_like_hf and res["half_fma"] > 0)


def sweep_specs():
    """The W4 matmuls at the tune_moe candidate tiles (gate_up BLOCK_N, down at twice it)."""
    moe = importlib.import_module("canvasq.kernels.moe.kernels")
    for bn, w, st in itertools.product((32, 64, 128), (4, 8), (2, 3, 4)):
        cfg = MoeLaunchConfig(
            gate_up_block_n=bn,
            gate_up_warps=w,
            gate_up_stages=st,
            down_block_n=2 * bn,
            down_warps=w,
            down_stages=st,
        )
        for spec in moe.compile_specs(cfg):
            if spec.name in ("gate_up", "down"):
                yield spec, f"bn={spec.constexprs['BLOCK_N']} w={w} s={st}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sweep", action="store_true", help="also compile the tune_moe candidate tiles")
    ap.add_argument("--only", default="", help="comma list of kernel-name prefixes (default: all)")
    a = ap.parse_args()
    rows, failed = [], False
    only = tuple(x for x in a.only.split(",") if x)
    for spec in all_specs():
        if only and not spec.name.startswith(only):
            continue
        res, bad = check(spec)
        rows.append({"kernel": spec.name, "config": "default", **res})
        failed |= bad
    if a.sweep:
        for spec, label in sweep_specs():
            try:
                rows.append({"kernel": spec.name, "config": label, **compile_kernel(spec)})
            except Exception as exc:  # noqa: BLE001 - report any lowering failure of a candidate
                rows.append({"kernel": spec.name, "config": label, "error": type(exc).__name__})
    for r in rows:
        print(r)
    print(json.dumps({"bench": "compile_check", "target": "sm_90", "ok": not failed, "kernels": len(rows)}))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
