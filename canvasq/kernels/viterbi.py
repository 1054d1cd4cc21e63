"""Structured output's best completable path (`decoders.grammar_device.DeviceGrammar.best`) in one
launch: one program per constrained row walks the canvas's C positions over the schema automaton's
edges and then back along the winning path.

The torch twin runs each position as a dozen small kernels (a scatter-max over the edges into the Q
states, then the edge that won each state); on a GPU a 64-row, 32-position canvas is ~380 launches
and ~9 ms of host time per decoder step at the testbed's size, and at the real vocabulary the
scatter-max's atomics into Q slots serialise (2.1 s per step at 64 rows, E = 253,173). Here the edges
are grouped by the state they enter (`csr`), so each state's best incoming edge is a plain reduction
over its segment; the running scores live in a per-row scratch that only the row's own program
touches (loads bypass L1: `.cg`).

Same arithmetic as the twin (fp32: the logit minus its position's log-sum-exp, added to the source
state's score; ties to the highest edge index), so the two give the same tokens.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._dispatch import interpreted


@triton.jit
def _viterbi_kernel(
    logits_ptr, stride_b, stride_c,  # [B, C, V] logits (any float dtype)
    rows_ptr, lse_ptr, back_ptr, start_ptr,  # [R] logits' rows, [R, C] fp32, [R, C + 1, Q] int8, [R] int32
    seg_ptr, src_ptr, tok_ptr, free_ptr, eid_ptr,  # the edges grouped by the state they enter
    osrc_ptr, otok_ptr,  # the edges in their own order (the walk back)
    score_ptr, via_ptr, toks_ptr, ends_ptr,  # [R, 2, QB] fp32 scratch, [R, C, Q] int32, [R, C], [R] int64
    C: tl.constexpr, Q: tl.constexpr, BLOCK: tl.constexpr, QB: tl.constexpr, INTERPRET_BLOCKS: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0)
    row = tl.load(rows_ptr + r).to(tl.int64)
    NEG_INF: tl.constexpr = float("-inf")
    qs = tl.arange(0, QB)
    start = tl.load(start_ptr + r)
    tl.store(score_ptr + r * 2 * QB + qs, tl.where(qs == start, 0.0, NEG_INF))
    tl.debug_barrier()
    for i in range(C):
        cur = score_ptr + (r * 2 + i % 2) * QB
        nxt = score_ptr + (r * 2 + 1 - i % 2) * QB
        lse = tl.load(lse_ptr + r * C + i)
        base = logits_ptr + row * stride_b + i * stride_c
        for qq in range(Q):
            ok = tl.load(back_ptr + (r * (C + 1) + i + 1) * Q + qq) != 0
            s0 = tl.load(seg_ptr + qq)
            s1 = tl.load(seg_ptr + qq + 1)
            best = lse * 0.0 + NEG_INF  # an fp32 scalar (loop-carried; lse is finite)
            arg = s0 * 0 - 1
            # the interpreter cannot run a loop of runtime length: a fixed count of masked blocks there
            for b in range(INTERPRET_BLOCKS if INTERPRET_BLOCKS > 0 else tl.cdiv(s1 - s0, BLOCK)):
                offs = s0 + b * BLOCK + tl.arange(0, BLOCK)
                m = offs < s1
                src = tl.load(src_ptr + offs, mask=m, other=0)
                sc = tl.load(cur + src, mask=m, other=NEG_INF, cache_modifier=".cg")
                tok = tl.load(tok_ptr + offs, mask=m, other=0)
                lg = tl.load(base + tok, mask=m, other=0.0).to(tl.float32)
                free = tl.load(free_ptr + offs, mask=m, other=0) != 0
                cand = tl.where(m, sc + tl.where(free, 0.0, lg - lse), NEG_INF)
                eid = tl.load(eid_ptr + offs, mask=m, other=-1)
                bm = tl.max(cand, 0)
                bid = tl.max(tl.where((cand == bm) & (cand > NEG_INF), eid, -1), 0)
                arg = tl.where(bm > best, bid, tl.where(bm == best, tl.maximum(arg, bid), arg))
                best = tl.maximum(best, bm)
            tl.store(nxt + qq, tl.where(ok, best, NEG_INF))
            tl.store(via_ptr + (r * C + i) * Q + qq, tl.where(ok, arg, -1))
        tl.debug_barrier()
    final = tl.load(score_ptr + (r * 2 + C % 2) * QB + qs, mask=qs < Q, other=NEG_INF, cache_modifier=".cg")
    q = tl.argmax(final, 0)
    tl.store(ends_ptr + r, q.to(tl.int64))
    for k in range(C):
        i = C - 1 - k
        e = tl.load(via_ptr + (r * C + i) * Q + q, cache_modifier=".cg")
        tl.store(toks_ptr + r * C + i, tl.load(otok_ptr + e).to(tl.int64))
        q = tl.load(osrc_ptr + e)


def csr(src: torch.Tensor, tok: torch.Tensor, dst: torch.Tensor, free: torch.Tensor, Q: int) -> dict:
    """The edges grouped by the state they enter (a stable sort: a group keeps the edges' order)."""
    order = torch.sort(dst, stable=True).indices
    counts = torch.bincount(dst, minlength=Q)
    seg = torch.zeros(Q + 1, dtype=torch.int32, device=dst.device)
    seg[1:] = torch.cumsum(counts, 0)
    i32 = torch.int32
    return {
        "seg": seg,
        "src": src[order].to(i32),
        "tok": tok[order].to(i32),
        "free": free[order].to(torch.int8),
        "eid": order.to(i32),
        "osrc": src.to(i32),
        "otok": tok.to(i32),
    }


def viterbi(
    logits: torch.Tensor,
    rows: torch.Tensor,
    lse: torch.Tensor,
    back: torch.Tensor,
    states: torch.Tensor,
    edges: dict,
    Q: int,
    block: int = 128,
) -> tuple[torch.Tensor, torch.Tensor]:
    """([R, C] tokens, [R] end states) of each row's best path: `logits` [B, C, V] (last dim
    contiguous), `rows` [R] of B, `lse` [R, C] fp32 (each read position's log-sum-exp), `back`
    [R, C + 1, Q] bool, `states` [R] start states, `edges` from `csr`."""
    R, C = len(rows), logits.shape[1]
    assert logits.stride(2) == 1, "the vocabulary must be contiguous"
    interpret = 0
    if interpreted(_viterbi_kernel):  # enough blocks for the longest segment
        interpret = max(1, triton.cdiv(int((edges["seg"][1:] - edges["seg"][:-1]).max()), block))
    QB = triton.next_power_of_2(max(Q, 2))
    dev = logits.device
    score = torch.empty(R, 2, QB, dtype=torch.float32, device=dev)
    via = torch.empty(R, C, Q, dtype=torch.int32, device=dev)
    toks = torch.empty(R, C, dtype=torch.int64, device=dev)
    ends = torch.empty(R, dtype=torch.int64, device=dev)
    if R == 0:
        return toks, ends
    _viterbi_kernel[(R,)](
        logits, logits.stride(0), logits.stride(1),
        rows.to(torch.int32), lse.contiguous(), back.to(torch.int8).contiguous(), states.to(torch.int32),
        edges["seg"], edges["src"], edges["tok"], edges["free"], edges["eid"], edges["osrc"], edges["otok"],
        score, via, toks, ends,
        C=C, Q=Q, BLOCK=block, QB=QB, INTERPRET_BLOCKS=interpret,
    )  # fmt: skip
    return toks, ends


def compile_specs():
    """A real-shape call: bf16 logits (benchmarks/kernels/compile_check.py)."""
    from .compile_spec import CompileSpec

    yield CompileSpec(
        "viterbi",
        _viterbi_kernel,
        {"C": 256, "Q": 20, "BLOCK": 128, "QB": 32, "INTERPRET_BLOCKS": 0},
        types={
            "rows_ptr": "*i32",
            "lse_ptr": "*fp32",
            "back_ptr": "*i8",
            "start_ptr": "*i32",
            "seg_ptr": "*i32",
            "src_ptr": "*i32",
            "tok_ptr": "*i32",
            "free_ptr": "*i8",
            "eid_ptr": "*i32",
            "osrc_ptr": "*i32",
            "otok_ptr": "*i32",
            "score_ptr": "*fp32",
            "via_ptr": "*i32",
            "toks_ptr": "*i64",
            "ends_ptr": "*i64",
        },
    )
