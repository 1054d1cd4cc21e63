"""How each kernel is compiled at the real shape, written beside the kernel (`compile_specs()` in its
module), so that benchmarks/kernels/compile_check.py can build every kernel for sm_90 on a machine
without a GPU and report registers, spills, shared memory and half-precision FMAs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from triton.runtime.jit import JITFunction


@dataclass(frozen=True)
class CompileSpec:
    """One compile of `fn` (a @triton.jit or @gluon.jit function) as its launcher calls it.

    `types` overrides the argument types, which default to `*bf16` for `*_ptr` arguments and `i32` for
    the other runtime ones; `divisible` names the arguments Triton marks divisible by 16 at launch when
    the real shapes allow it. `rounds_like_hf`: the kernel must round where HF's modules round, so a
    half-precision FMA in its PTX is an error. `spill_bytes`: stack allowed for a tile measured fastest
    although it spills."""

    name: str
    fn: JITFunction
    constexprs: dict
    types: dict[str, str] = field(default_factory=dict)
    divisible: frozenset[str] = frozenset()
    num_warps: int = 4
    num_stages: int = 1
    options: dict = field(default_factory=dict)
    rounds_like_hf: bool = False
    spill_bytes: int = 0

    def arg_types(self) -> dict[str, str]:
        """Every runtime argument's type, in the kernel's argument order (constexprs left out)."""
        names = [n for n in self.fn.arg_names if n not in self.constexprs and n != "PDL"]
        return {n: self.types.get(n, "*bf16" if n.endswith("_ptr") else "i32") for n in names}


def pointers_and_strides(fn, *extra: str) -> frozenset[str]:
    """The usual `divisible` set: every pointer and stride argument of `fn`, plus those of `extra` it has."""
    return frozenset(n for n in fn.arg_names if n.endswith("_ptr") or n.startswith("stride") or n in extra)
