"""Structured output's pins (`decoders.constraint_rules.pin`): chosen (row, position) logits made one-hot
on a token, in place, without the host knowing which positions are pinned.

The rules decide their pins on the device ([R, C] tokens, -1 where a position is free), so a torch
version would either read them back (a host sync mid-step) or rewrite every position of the rows'
logits through a select. Here one program per (row, position) reads its pin and returns at once when
there is none; a pinned position's program writes `neg` over its V logits and 0 at the token.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_V = 1024


@triton.jit
def _pin_kernel(
    logits_ptr, stride_b, stride_c,  # [B, C, V] logits, written in place (last dim contiguous)
    rows_ptr, pins_ptr,  # [R] rows of logits (int32 or int64), [R, C] int64 pinned token (-1: none)
    neg,
    V: tl.constexpr, C: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    tok = tl.load(pins_ptr + pid)
    if tok >= 0:
        row = tl.load(rows_ptr + pid // C).to(tl.int64)
        base = logits_ptr + row * stride_b + (pid % C) * stride_c
        cols = tl.arange(0, BLOCK_V)
        for v0 in range(0, V, BLOCK_V):
            v = v0 + cols
            val = tl.where(v == tok, 0.0, neg)
            tl.store(base + v, val.to(logits_ptr.dtype.element_ty), mask=v < V)


def pin_positions(logits: torch.Tensor, rows: torch.Tensor, pins: torch.Tensor, neg: float) -> None:
    """logits [B, C, V] (last dimension contiguous): for each r, c with pins[r, c] >= 0, the logits of
    row rows[r] at position c set to `neg` except that token's (0)."""
    R, C = pins.shape
    if R == 0:
        return
    assert logits.stride(2) == 1 and logits.shape[1] == C
    _pin_kernel[(R * C,)](
        logits,
        logits.stride(0),
        logits.stride(1),
        rows.contiguous(),
        pins.contiguous(),
        neg,
        V=logits.shape[2],
        C=C,
        BLOCK_V=BLOCK_V,
    )


def compile_specs():
    """The pin at the real canvas and vocabulary (benchmarks/kernels/compile_check.py)."""
    from .compile_spec import CompileSpec

    yield CompileSpec(
        "pin",
        _pin_kernel,
        {"V": 262144, "C": 256, "BLOCK_V": BLOCK_V},
        types={"logits_ptr": "*fp32", "rows_ptr": "*i32", "pins_ptr": "*i64", "neg": "fp32"},
    )
