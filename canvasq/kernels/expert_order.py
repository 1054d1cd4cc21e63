"""The FP8 experts' routing order in two launches (`model.fp8.expert_order`'s "chunks"): the assignments
t*K + j in expert order, stable, each expert's end and each assignment's place, what torch's stable
sort, its searchsorted and a scatter give. Why: that path is about 13 launches a layer (an H200
forward's profile, `benchmarks/results/h200_2026-12-07_s47_i34_combine_quant_a54c831`), 33-37 µs a
call even from a CUDA graph on an H100 at 4,096-16,384 tokens (BENCHMARKS.md, "Service throughput",
the one-byte keys' table).

- `_chunk_counts`: a program a CHUNK of assignments, their histogram over the experts (`hist` [C, E]).
- `_place`: a program a chunk again. From the histograms, each expert's first place (the counts of
  the experts before it) plus the chunk's earlier chunks' assignments of that expert; the chunk's
  keys (expert, index) sorted in registers (`tl.sort`), so equal experts keep index order; a sorted
  key's place is its expert's base plus its rank among the chunk's keys of that expert (its sorted
  position less the chunk's assignments of smaller experts, read back through `shift`, a row of
  scratch). Program 0 writes the ends.

No atomics and no global sort. Chunks up to C_MAX (the histograms are one masked load); a larger
routing, or more than E_MAX experts, takes the sort.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 1024  # assignments a program (keys of 10 bits of index)
C_MAX = 128  # chunks: 131,072 assignments, 64 windows of 256 rows at top-8
E_MAX = 256


@triton.jit
def _chunk_counts(ids_ptr, hist_ptr, n, E_POW2: tl.constexpr, CHUNK: tl.constexpr):
    c = tl.program_id(0)
    i = c * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + i, mask=i < n, other=0).to(tl.int32)
    tl.store(hist_ptr + c * E_POW2 + tl.arange(0, E_POW2), tl.histogram(ids, E_POW2, mask=i < n))


@triton.jit
def _place(
    ids_ptr,
    hist_ptr,
    shift_ptr,
    order_ptr,
    row_of_ptr,
    offs_ptr,
    n,
    chunks,
    E,
    E_POW2: tl.constexpr,
    CHUNK: tl.constexpr,
    C_MAX: tl.constexpr,
    BITS: tl.constexpr,
):
    c = tl.program_id(0)
    ex = tl.arange(0, E_POW2)
    rows = tl.arange(0, C_MAX)
    hist = tl.load(hist_ptr + rows[:, None] * E_POW2 + ex[None, :], mask=(rows < chunks)[:, None], other=0)
    counts = tl.sum(hist, 0)
    ends = tl.cumsum(counts, 0)
    mine = tl.sum(tl.where((rows == c)[:, None], hist, 0), 0)
    base = ends - counts + tl.sum(tl.where((rows < c)[:, None], hist, 0), 0)
    if c == 0:
        tl.store(offs_ptr + ex, ends, mask=ex < E)
    # a sorted key at chunk position p lands at base[e] + p - (the chunk's keys of experts below e)
    tl.store(shift_ptr + c * E_POW2 + ex, base - (tl.cumsum(mine, 0) - mine))
    tl.debug_barrier()  # the row written above is read back by other threads of this program
    p = tl.arange(0, CHUNK)  # an assignment's index in the chunk; after the sort, a key's position
    i = c * CHUNK + p
    ids = tl.load(ids_ptr + i, mask=i < n, other=E_POW2).to(tl.int32)  # past n: after every expert
    keys = tl.sort((ids << BITS) | p)
    e, at = keys >> BITS, keys & (CHUNK - 1)
    live = e < E_POW2
    place = tl.load(shift_ptr + c * E_POW2 + e, mask=live, other=0) + p
    src = (c * CHUNK + at).to(tl.int64)
    tl.store(order_ptr + place, src, mask=live)
    tl.store(row_of_ptr + src, place.to(tl.int64), mask=live)


def takes(topk_ids: torch.Tensor, num_experts: int, chunk: int = CHUNK) -> bool:
    """Whether the two launches can order this routing (else the caller sorts)."""
    return topk_ids.numel() <= C_MAX * chunk and triton.next_power_of_2(num_experts) <= E_MAX


def expert_order_chunks(
    topk_ids: torch.Tensor, num_experts: int, chunk: int = CHUNK
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_ids [T, K] -> (order [T*K] int64, offs [E] int32, row_of [T*K] int64), as
    `model.fp8.expert_order` gives them; `takes` must hold. `chunk`: assignments a program (a power of
    two; the CPU tests take small ones to cross chunk edges)."""
    assert takes(topk_ids, num_experts, chunk) and chunk & (chunk - 1) == 0
    flat = topk_ids.reshape(-1).contiguous()
    n, dev, e_pow2 = flat.numel(), flat.device, triton.next_power_of_2(num_experts)
    chunks = max(1, triton.cdiv(n, chunk))
    hist = torch.empty(chunks, e_pow2, dtype=torch.int32, device=dev)
    shift = torch.empty(chunks, e_pow2, dtype=torch.int32, device=dev)
    order = torch.empty(n, dtype=torch.int64, device=dev)
    row_of = torch.empty(n, dtype=torch.int64, device=dev)
    offs = torch.empty(num_experts, dtype=torch.int32, device=dev)
    _chunk_counts[(chunks,)](flat, hist, n, E_POW2=e_pow2, CHUNK=chunk, num_warps=4)
    _place[(chunks,)](
        flat, hist, shift, order, row_of, offs, n, chunks, num_experts,
        E_POW2=e_pow2, CHUNK=chunk, C_MAX=C_MAX, BITS=chunk.bit_length() - 1, num_warps=8,
    )  # fmt: skip
    return order, offs, row_of


def compile_specs():
    """Both launches at 128 experts (benchmarks/kernels/compile_check.py)."""
    from .compile_spec import CompileSpec

    types = {"ids_ptr": "*i64", "hist_ptr": "*i32", "shift_ptr": "*i32", "order_ptr": "*i64"}
    types |= {"row_of_ptr": "*i64", "offs_ptr": "*i32"}
    yield CompileSpec(
        "expert_order_counts", _chunk_counts, {"E_POW2": 128, "CHUNK": CHUNK}, types=types, num_warps=4
    )
    consts = {"E_POW2": 128, "CHUNK": CHUNK, "C_MAX": C_MAX, "BITS": CHUNK.bit_length() - 1}
    yield CompileSpec("expert_order_place", _place, consts, types=types, num_warps=8)
