"""Structured output's best completable path (`decoders.grammar_device.DeviceGrammar.best`) in one
launch: one program per constrained row walks the canvas's C positions over the schema automaton's
edges and then back along the winning path.

The torch twin runs each position as a dozen small kernels (a scatter-max over the edges into the Q
states, then the edge that won each state); on a GPU a 64-row, 32-position canvas is ~380 launches
and ~9 ms of host time per decoder step at the testbed's size, and at the real vocabulary the
scatter-max's atomics into Q slots serialise (2.1 s per step at 64 rows, E = 253,173).

Here the edges are grouped by the state they enter (`csr`) and cut into chunks of at most BLOCK edges
(a state with many edges, such as a thought's, has several). At each position a program scores all
its row's chunks as one [chunks, BLOCK] tile (each chunk's best edge, ties to the highest edge index),
then each state reduces its own chunks' winners as one [Q, chunks per state] tile. Tiles, because a
walk over the states one by one makes every position Q chains of dependent loads (a state's segment,
its edges, their sources' scores, their tokens' logits): latency that grows with the schema's states
however few their edges. The tiles keep the chain at two levels a position.

A (source, destination) pair that many tokens connect (a string's or a thought's free text: nearly the
whole vocabulary at the real size, 253,173 of 253,190 edges in the real-shape micro) is one
*class*: its best edge at a position is the best of its tokens there, found for every position at
once by `class_best` (one program per (row, position) over the vocabulary, the way the masks read it)
before the walk; the walk then scores one virtual edge per class instead of its members, and takes the
member's edge index from the class's winner. The winner among equal logits is the member of highest
edge index, the twin's rule, so the paths are the twin's.

The running scores and the chunks' winners live in a per-row scratch that only the row's own program
touches (loads bypass L1: `.cg`). Same arithmetic as the twin (fp32: the logit minus its position's
log-sum-exp, added to the source state's score; ties to the highest edge index), so the two give the
same tokens.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# the most elements of one tile (a [chunks, BLOCK] or [states, chunks] block of a position's work)
TILE = 4096
# a (source, destination) pair with at least this many edges is a class (`csr`), at most MAX_CLASSES of
# them (the largest): the testbed's (V 748) has none, the real vocabulary's free-text pairs do. Not
# lowered for small vocabularies: a class costs a launch (`class_best`) and two buffers a step, and at
# the testbed's the thought's free text (609 edges) as a class narrowed `answer_totals`' tiles 16,384 ->
# 6,144 elements a position but the walk's device time only 291 -> 237 µs on an H100 (it waits on its
# chain of loads, not its tiles' width), and in the stream, arm against arm in one process, the class
# changed `answer_totals`' wall by nothing measurable (BENCHMARKS.md, "The overhead bar read four ways")
CLASS_MIN = 1024
MAX_CLASSES = 8
# the chunk sizes `layout` picks from
BLOCKS = (8, 16, 32)
BLOCK_V = 1024


@triton.jit
def _class_best_kernel(
    logits_ptr, stride_b, stride_c,  # [B, C, V] logits (any float dtype)
    rows_ptr, members_ptr,  # [R] logits' rows; [KC, V] int32: each class's member edge per token, -1: none
    best_ptr, arg_ptr,  # [R, C, KC] out: fp32 best logit, int32 its member's edge index
    V: tl.constexpr, C: tl.constexpr, KC: tl.constexpr, KCB: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    row = tl.load(rows_ptr + pid // C).to(tl.int64)
    base = logits_ptr + row * stride_b + (pid % C) * stride_c
    ks = tl.arange(0, KCB)
    cols = tl.arange(0, BLOCK_V)
    best = tl.full([KCB], float("-inf"), tl.float32)
    arg = tl.full([KCB], -1, tl.int32)
    for v0 in range(0, V, BLOCK_V):
        v = v0 + cols
        x = tl.load(base + v, mask=v < V, other=0.0).to(tl.float32)
        e = tl.load(
            members_ptr + ks[:, None] * V + v[None, :], mask=(ks[:, None] < KC) & (v[None, :] < V), other=-1
        )
        xx = tl.where(e >= 0, x[None, :], float("-inf"))
        bm = tl.max(xx, 1)
        ba = tl.max(tl.where((xx == bm[:, None]) & (e >= 0), e, -1), 1)  # ties: the highest edge index
        arg = tl.where(bm > best, ba, tl.where(bm == best, tl.maximum(arg, ba), arg))
        best = tl.maximum(best, bm)
    tl.store(best_ptr + pid * KC + ks, best, mask=ks < KC)
    tl.store(arg_ptr + pid * KC + ks, arg, mask=ks < KC)


def class_best(
    logits: torch.Tensor, rows: torch.Tensor, members: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each class's best member at every position of rows `rows` of logits [B, C, V] (last dim
    contiguous): ([R, C, KC] fp32 logit, [R, C, KC] int32 the member's edge index; ties: the highest)."""
    R, C, V = len(rows), logits.shape[1], logits.shape[2]
    KC = members.shape[0]
    best = torch.empty(R, C, KC, dtype=torch.float32, device=logits.device)
    arg = torch.empty(R, C, KC, dtype=torch.int32, device=logits.device)
    if R and KC:
        _class_best_kernel[(R * C,)](
            logits, logits.stride(0), logits.stride(1), rows, members, best, arg,
            V=V, C=C, KC=KC, KCB=triton.next_power_of_2(KC), BLOCK_V=min(BLOCK_V, triton.next_power_of_2(V)),
        )  # fmt: skip
    return best, arg


@triton.jit
def _viterbi_kernel(
    logits_ptr, stride_b, stride_c,  # [B, C, V] logits (any float dtype)
    rows_ptr, lse_ptr, back_ptr, brow_ptr, start_ptr,  # [R] logits' rows, [R, C] fp32, [N, C + 1, Q] int8,
    # [R] each row's in back, [R] start states (int32)
    cs_ptr, ce_ptr, kseg_ptr,  # [K] each chunk's edges [cs, ce) in grouped order, [Q + 1] each state's chunks
    src_ptr, tok_ptr, free_ptr, eid_ptr,  # the edges grouped by the state they enter
    osrc_ptr, otok_ptr,  # the edges in their own order (the walk back)
    cls_best_ptr, cls_arg_ptr,  # [R, C, KC] the classes' best member logits and edge indices (`class_best`)
    score_ptr, cbest_ptr, carg_ptr, via_ptr, toks_ptr, ends_ptr,  # [R, 2, QB] fp32, [R, KP] fp32 / int32 scratch,
    # [R, C, Q] int32, [R, C], [R] int64
    C: tl.constexpr, Q: tl.constexpr, K: tl.constexpr, BLOCK: tl.constexpr, QB: tl.constexpr, KC: tl.constexpr,
    CB: tl.constexpr, NCB: tl.constexpr, KB: tl.constexpr, NKB: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0)
    row = tl.load(rows_ptr + r).to(tl.int64)
    NEG_INF: tl.constexpr = float("-inf")
    KP: tl.constexpr = CB * NCB
    qs = tl.arange(0, QB)
    qm = qs < Q
    start = tl.load(start_ptr + r)
    brow = tl.load(brow_ptr + r).to(tl.int64)
    tl.store(score_ptr + r * 2 * QB + qs, tl.where(qs == start, 0.0, NEG_INF))
    k0 = tl.load(kseg_ptr + qs, mask=qm, other=0)
    k1 = tl.load(kseg_ptr + qs + 1, mask=qm, other=0)
    lanes = tl.arange(0, BLOCK)
    tl.debug_barrier()
    for i in range(C):
        cur = score_ptr + (r * 2 + i % 2) * QB
        nxt = score_ptr + (r * 2 + 1 - i % 2) * QB
        lse = tl.load(lse_ptr + r * C + i)
        base = logits_ptr + row * stride_b + i * stride_c
        for cb in range(NCB):  # each chunk's best edge
            ks = cb * CB + tl.arange(0, CB)
            km = ks < K
            c0 = tl.load(cs_ptr + ks, mask=km, other=0)
            c1 = tl.load(ce_ptr + ks, mask=km, other=0)
            offs = c0[:, None] + lanes[None, :]
            m = offs < c1[:, None]
            src = tl.load(src_ptr + offs, mask=m, other=0)
            sc = tl.load(cur + src, mask=m, other=NEG_INF, cache_modifier=".cg")
            tok = tl.load(tok_ptr + offs, mask=m, other=0)
            eid = tl.load(eid_ptr + offs, mask=m, other=-1)
            if KC > 0:  # a class's virtual edge (token -1 - k): its best member here, and that member's edge
                virt = tok < 0
                kc = (r * C + i) * KC + tl.where(virt, -1 - tok, 0)
                lg = tl.load(base + tl.where(virt, 0, tok), mask=m & ~virt, other=0.0).to(tl.float32)
                lg = tl.where(virt, tl.load(cls_best_ptr + kc, mask=m & virt, other=0.0), lg)
                eid = tl.where(virt, tl.load(cls_arg_ptr + kc, mask=m & virt, other=-1), eid)
            else:
                lg = tl.load(base + tok, mask=m, other=0.0).to(tl.float32)
            free = tl.load(free_ptr + offs, mask=m, other=0) != 0
            cand = tl.where(m, sc + tl.where(free, 0.0, lg - lse), NEG_INF)
            bm = tl.max(cand, 1)
            bid = tl.max(tl.where((cand == bm[:, None]) & (cand > NEG_INF), eid, -1), 1)
            tl.store(cbest_ptr + r * KP + ks, bm, mask=km)
            tl.store(carg_ptr + r * KP + ks, bid, mask=km)
        tl.debug_barrier()
        best = tl.full((QB,), NEG_INF, tl.float32)
        arg = tl.full((QB,), -1, tl.int32)
        for kb in range(NKB):  # each state's best over its chunks (ties: the highest edge index)
            kk = k0[:, None] + kb * KB + tl.arange(0, KB)[None, :]
            mm = kk < k1[:, None]
            b = tl.load(cbest_ptr + r * KP + kk, mask=mm, other=NEG_INF, cache_modifier=".cg")
            a = tl.load(carg_ptr + r * KP + kk, mask=mm, other=-1, cache_modifier=".cg")
            bm = tl.max(b, 1)
            bid = tl.max(tl.where((b == bm[:, None]) & (b > NEG_INF), a, -1), 1)
            arg = tl.where(bm > best, bid, tl.where(bm == best, tl.maximum(arg, bid), arg))
            best = tl.maximum(best, bm)
        ok = tl.load(back_ptr + (brow * (C + 1) + i + 1) * Q + qs, mask=qm, other=0) != 0
        tl.store(nxt + qs, tl.where(ok, best, NEG_INF), mask=qm)
        tl.store(via_ptr + (r * C + i) * Q + qs, tl.where(ok, arg, -1), mask=qm)
        tl.debug_barrier()
    final = tl.load(score_ptr + (r * 2 + C % 2) * QB + qs, mask=qm, other=NEG_INF, cache_modifier=".cg")
    q = tl.argmax(final, 0)
    tl.store(ends_ptr + r, q.to(tl.int64))
    for k in range(C):
        i = C - 1 - k
        e = tl.load(via_ptr + (r * C + i) * Q + q, cache_modifier=".cg")
        tl.store(toks_ptr + r * C + i, tl.load(otok_ptr + e).to(tl.int64))
        q = tl.load(osrc_ptr + e)


def csr(
    src: torch.Tensor,
    tok: torch.Tensor,
    dst: torch.Tensor,
    free: torch.Tensor,
    Q: int,
    V: int,
    block: int = 32,
    class_min: int = CLASS_MIN,
) -> dict:
    """The edges grouped by the state they enter (a stable sort: a group keeps the edges' order), each
    group cut into chunks of at most `block` edges. `V`: the logits' width. The (source, destination) pairs of at least `class_min` edges (at most MAX_CLASSES, the largest) are classes:
    their members leave the groups for one virtual edge each (token -1 - k), and `members` [KC, V]
    int32 maps each class's tokens to their edges (-1: not a member)."""
    dev, i32 = dst.device, torch.int32
    keep, members, (vsrc, vdst) = _classes(src, tok, dst, Q, V, class_min)
    vtok = -1 - torch.arange(len(vsrc), device=dev)
    # the kept edges, then one virtual edge per class (its edge index comes from `class_best`)
    g_src = torch.cat([src[keep], vsrc])
    g_tok = torch.cat([tok[keep], vtok])
    g_dst = torch.cat([dst[keep], vdst])
    g_free = torch.cat([free[keep], torch.zeros(len(vsrc), dtype=free.dtype, device=dev)])
    g_eid = torch.cat([keep, torch.full((len(vsrc),), -1, dtype=torch.long, device=dev)])
    order = torch.sort(g_dst, stable=True).indices
    counts = torch.bincount(g_dst, minlength=Q)
    seg = torch.zeros(Q + 1, dtype=torch.long, device=dev)
    seg[1:] = torch.cumsum(counts, 0)
    chunks = (counts + block - 1) // block  # [Q]
    kseg = torch.zeros(Q + 1, dtype=torch.long, device=dev)
    kseg[1:] = torch.cumsum(chunks, 0)
    K = int(kseg[-1])
    state = torch.repeat_interleave(torch.arange(Q, device=dev), chunks)  # [K] each chunk's state
    cs = seg[state] + (torch.arange(K, device=dev) - kseg[state]) * block
    ce = torch.minimum(cs + block, seg[state + 1])
    return {
        "block": block,
        "K": K,
        "most_chunks": int(chunks.max()) if Q else 0,
        "cs": cs.to(i32),
        "ce": ce.to(i32),
        "kseg": kseg.to(i32),
        "src": g_src[order].to(i32),
        "tok": g_tok[order].to(i32),
        "free": g_free[order].to(torch.int8),
        "eid": g_eid[order].to(i32),
        "osrc": src.to(i32),
        "otok": tok.to(i32),
        "members": members,
    }


def _classes(src: torch.Tensor, tok: torch.Tensor, dst: torch.Tensor, Q: int, V: int, class_min: int):
    """`csr`'s classes: ([E'] the edges kept as edges, [KC, V] int32 each class's member edge per token,
    ([KC] sources, [KC] destinations) of the classes' pairs); KC is 0 when no pair is large enough."""
    dev = dst.device
    uniq, inv, counts = torch.unique(src * Q + dst, return_inverse=True, return_counts=True)
    big = torch.nonzero(counts >= class_min)[:, 0]
    big = big[torch.argsort(counts[big], descending=True, stable=True)][:MAX_CLASSES]
    klass = torch.full((len(uniq),), -1, dtype=torch.long, device=dev)
    klass[big] = torch.arange(len(big), device=dev)
    k = klass[inv]  # [E] each edge's class, -1: none
    inside = k >= 0
    members = torch.full((len(big), V), -1, dtype=torch.int32, device=dev)
    members[k[inside], tok[inside]] = torch.nonzero(inside)[:, 0].to(torch.int32)
    return torch.nonzero(~inside)[:, 0], members, (uniq[big] // Q, uniq[big] % Q)


def layout(
    src, tok, dst, free, Q: int, V: int, blocks=BLOCKS, tile: int = TILE, class_min: int = CLASS_MIN
) -> dict:
    """`csr` at the chunk size of `blocks` whose tiles hold the fewest elements a position (the walk
    scores every element of its tiles, padding included): a schema of many one-chunk states wants
    small chunks, one whose states have many edges larger ones."""

    def work(e: dict) -> int:
        t = tiles(e["K"], e["most_chunks"], e["block"], Q, tile)
        return t["NCB"] * t["CB"] * e["block"] + t["NKB"] * t["QB"] * t["KB"]

    return min((csr(src, tok, dst, free, Q, V, b, class_min) for b in blocks), key=work)


def tiles(K: int, most_chunks: int, block: int, Q: int, tile: int = TILE) -> dict:
    """The kernel's tile constants: chunks scored CB at a time (NCB tiles), each state's chunks read KB
    at a time (NKB tiles), every tile at most `tile` elements (tests shrink it to run several)."""
    QB = triton.next_power_of_2(max(Q, 2))
    CB = max(1, min(triton.next_power_of_2(max(K, 1)), tile // block))
    KB = max(1, min(triton.next_power_of_2(max(most_chunks, 1)), tile // QB))
    return {
        "QB": QB,
        "CB": CB,
        "NCB": triton.cdiv(max(K, 1), CB),
        "KB": KB,
        "NKB": triton.cdiv(max(most_chunks, 1), KB),
    }


def viterbi(
    logits: torch.Tensor,
    rows: torch.Tensor,
    lse: torch.Tensor,
    back: torch.Tensor,
    states: torch.Tensor,
    edges: dict,
    Q: int,
    tile: int = TILE,
    back_rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """([R, C] tokens, [R] end states) of each row's best path: `logits` [B, C, V] (last dim
    contiguous), `rows` [R] of B, `lse` [R, C] fp32 (each read position's log-sum-exp), `back`
    [N, C + 1, Q] bool or int8 backward sets, row r's at `back_rows[r]` (default: r), `states` [R]
    start states, `edges` from `csr`, `tile` the most elements a tile holds. Integer columns already
    int32 and `back` int8 are read as they are (no cast launched)."""
    R, C = len(rows), logits.shape[1]
    assert logits.stride(2) == 1, "the vocabulary must be contiguous"
    t = tiles(edges["K"], edges["most_chunks"], edges["block"], Q, tile)
    dev = logits.device
    score = torch.empty(R, 2, t["QB"], dtype=torch.float32, device=dev)
    cbest = torch.empty(R, t["CB"] * t["NCB"], dtype=torch.float32, device=dev)
    carg = torch.empty(R, t["CB"] * t["NCB"], dtype=torch.int32, device=dev)
    via = torch.empty(R, C, Q, dtype=torch.int32, device=dev)
    toks = torch.empty(R, C, dtype=torch.int64, device=dev)
    ends = torch.empty(R, dtype=torch.int64, device=dev)
    if R == 0:
        return toks, ends
    if back_rows is None:
        back_rows = torch.arange(R, dtype=torch.int32, device=dev)
    rows = rows.to(torch.int32)
    KC = edges["members"].shape[0]
    cls_best, cls_arg = class_best(logits, rows, edges["members"]) if KC else (score, carg)
    _viterbi_kernel[(R,)](
        logits, logits.stride(0), logits.stride(1),
        rows, lse.contiguous(), back.to(torch.int8).contiguous(), back_rows.to(torch.int32),
        states.to(torch.int32),
        edges["cs"], edges["ce"], edges["kseg"],
        edges["src"], edges["tok"], edges["free"], edges["eid"], edges["osrc"], edges["otok"],
        cls_best, cls_arg,
        score, cbest, carg, via, toks, ends,
        C=C, Q=Q, K=edges["K"], BLOCK=edges["block"], KC=KC, **t, num_warps=8,
    )  # fmt: skip
    return toks, ends


def compile_specs():
    """A real-shape call: bf16 logits (benchmarks/kernels/compile_check.py)."""
    from .compile_spec import CompileSpec

    yield CompileSpec(
        "viterbi",
        _viterbi_kernel,
        # the real-shape micro's automaton once its free-text pair is a class: a few hundred edges left
        {"C": 256, "Q": 20, "K": 16, "BLOCK": 32, "KC": 1, **tiles(16, 8, 32, 20)},
        types=(
            types := {
                "rows_ptr": "*i32",
                "lse_ptr": "*fp32",
                "back_ptr": "*i8",
                "brow_ptr": "*i32",
                "start_ptr": "*i32",
                "cs_ptr": "*i32",
                "ce_ptr": "*i32",
                "kseg_ptr": "*i32",
                "src_ptr": "*i32",
                "tok_ptr": "*i32",
                "free_ptr": "*i8",
                "eid_ptr": "*i32",
                "osrc_ptr": "*i32",
                "otok_ptr": "*i32",
                "cls_best_ptr": "*fp32",
                "cls_arg_ptr": "*i32",
                "score_ptr": "*fp32",
                "cbest_ptr": "*fp32",
                "carg_ptr": "*i32",
                "via_ptr": "*i32",
                "toks_ptr": "*i64",
                "ends_ptr": "*i64",
            }
        ),
        num_warps=8,
    )
    yield CompileSpec(
        "viterbi_testbed",
        _viterbi_kernel,
        # the testbed's `answer_totals` after a thought as `layout` lays it out (chunks of 16, one class)
        {"C": 32, "Q": 163, "K": 182, "BLOCK": 16, "KC": 1, **tiles(182, 7, 16, 163)},
        types=types,
        num_warps=8,
    )
    yield CompileSpec(
        "class_best",
        _class_best_kernel,
        {"V": 262144, "C": 256, "KC": 2, "KCB": 2, "BLOCK_V": BLOCK_V},
        types={
            "logits_ptr": "*bf16",
            "rows_ptr": "*i32",
            "members_ptr": "*i32",
            "best_ptr": "*fp32",
            "arg_ptr": "*i32",
        },
    )
