"""Fused softmax statistics over the vocabulary without materialising probabilities.

logits [R, V] (fp32/bf16/fp16) -> conf [R] fp32 (max probability), argmax [R] int64 (first maximum,
as torch.argmax), entropy [R] fp32 (nats), all at temperature `temperature` (logits / temperature).

Two passes of one read: stage 1 splits each row into CHUNKS slices and keeps, per lane, a running max m,
s = sum exp(l - m), u = sum exp(l - m) * (l - m) and the first index of the max (one exp per logit:
exp(-|l - m|) serves both the new-max and the old-max case); lanes then merge into one partial per
(row, slice). Stage 2 merges a row's partials in fixed slice order (deterministic).
With S = sum exp(l - M) and U = sum exp(l - M)(l - M): conf = 1 / S, entropy = log S - U / S.
Rescaling to a new max m' multiplies s by a = exp(m - m') and turns u into a * (u + (m - m') s).

`softmax_sample` adds, in the same read, a draw from softmax(logits / T) per row by the Gumbel-max
rule (argmax of l / T + G, G = -log(-log U)) and a uniform "renoise" token, from a counter-based
generator (Philox) keyed by one seed per group of rows: a row's draws depend on its seed, its index
within the group and the vocabulary index, never on the other rows of the launch (batch-invariant).
By default (`RAND4`) one Philox call serves 4 neighbouring columns: the draws' integer work is a
quarter of a call per column, which at the real vocabulary is most of the pass's arithmetic.
Temperatures come per group too, so a batch of requests at different steps shares one launch.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ._dispatch import auto_triton, interpreted
from .softcap import cap_args, softcap_on_read
from .softmax_invcdf import draw_invcdf, invcdf_rule, lane_sums
from .softmax_topk import top_k_scaled


class SampleStats(NamedTuple):
    """Per row of `softmax_sample`: [R] each, top_vals / top_ids [R, k] (None without top_k)."""

    conf: torch.Tensor
    argmax: torch.Tensor
    entropy: torch.Tensor
    draw: torch.Tensor
    noise: torch.Tensor
    top_vals: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None


@triton.jit
def _merge(m1, s1, u1, i1, m2, s2, u2, i2):
    # merge two (max, sum, u, argmax) states; -inf maxima contribute nothing; ties keep the lower index
    m = tl.maximum(m1, m2)
    m_safe = tl.where(m > float("-inf"), m, 0.0)  # keeps -inf - -inf (NaN) out of both where branches
    d1 = tl.where(m1 > float("-inf"), m1 - m_safe, 0.0)
    d2 = tl.where(m2 > float("-inf"), m2 - m_safe, 0.0)
    a1 = tl.where(m1 > float("-inf"), tl.exp(d1), 0.0)
    a2 = tl.where(m2 > float("-inf"), tl.exp(d2), 0.0)
    s = a1 * s1 + a2 * s2
    u = a1 * (u1 + d1 * s1) + a2 * (u2 + d2 * s2)
    idx = tl.where(m1 == m2, tl.minimum(i1, i2), tl.where(m1 > m2, i1, i2))
    return m, s, u, idx


@triton.jit
def _reduce_lanes(m, s, u, i):
    # the same merge across a vector of lane states, with built-in reductions (tl.reduce with a
    # Python combine function crawls under the interpreter)
    mx = tl.max(m, axis=0)
    live = m > float("-inf")
    d = tl.where(live, m - tl.where(mx > float("-inf"), mx, 0.0), 0.0)
    a = tl.where(live, tl.exp(d), 0.0)
    s_r = tl.sum(a * s, axis=0)
    u_r = tl.sum(a * (u + d * s), axis=0)
    i_r = tl.min(tl.where(m == mx, i, 2147483647), axis=0)
    return mx, s_r, u_r, i_r


@triton.jit
def _softmax_stats_partial_kernel(
    logits_ptr,
    pm_ptr,
    ps_ptr,
    pu_ptr,
    pi_ptr,
    pg_ptr,
    pgi_ptr,
    inv_temp_ptr,
    seed_ptr,
    lane_max_ptr,
    lane_sum_ptr,
    V,
    stride_r,
    GROUP,
    inv_cap,
    cap,
    CHUNKS: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_V: tl.constexpr,
    SAMPLE: tl.constexpr,
    LANE_MAX: tl.constexpr,
    LANE_SUM: tl.constexpr,
    RAND4: tl.constexpr,
    SOFTCAP: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    lanes = tl.arange(0, BLOCK_V)
    group = row // GROUP
    inv_temp = tl.load(inv_temp_ptr + group)
    if SAMPLE:
        seed = tl.load(seed_ptr + group)
        base = ((row % GROUP) * V).to(tl.int32)  # Philox counter: position in the group x vocabulary
        base4 = ((row % GROUP) * tl.cdiv(V, 4)).to(tl.int32)  # RAND4: one counter per 4 columns
        quads = tl.arange(0, BLOCK_V // 4)
        gm = tl.full((BLOCK_V,), float("-inf"), tl.float32)  # running max of l / T + Gumbel noise
        gi = tl.full((BLOCK_V,), 2147483647, tl.int32)
    # a finite "-inf" for the running max: the first finite logit then rescales s and u by exp(-huge)
    # == 0 without an inf * 0; real -inf logits (masked vocabulary) are skipped explicitly
    m = tl.full((BLOCK_V,), -1e30, tl.float32)
    s = tl.zeros((BLOCK_V,), tl.float32)
    u = tl.zeros((BLOCK_V,), tl.float32)
    idx = tl.full((BLOCK_V,), 2147483647, tl.int32)
    start = c * CHUNK
    for off in range(0, CHUNK, BLOCK_V):
        cols = start + off + lanes
        l = tl.load(logits_ptr + row * stride_r + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        if SOFTCAP:  # the LM head's final soft cap on read (`softcap.py`'s math): no capped copy
            l = softcap_on_read(l, inv_cap, cap, INTERPRETED)
        l = l * inv_temp
        live = l > float("-inf")
        d = tl.where(live, l - m, 0.0)
        e = tl.where(live, tl.exp(-tl.abs(d)), 0.0)  # one exp per logit
        up = d > 0  # new lane maximum: rescale the old sums to it
        s_new = tl.where(up, s * e + 1.0, s + e)
        u = tl.where(up, e * (u - d * s), u + e * d)
        s = s_new
        idx = tl.where(up, cols, idx)
        m = tl.where(up, l, m)
        if SAMPLE:
            if RAND4:  # one Philox call gives the uniforms of 4 neighbouring columns (4x fewer rounds)
                r0, r1, r2, r3 = tl.rand4x(seed, base4 + (start + off) // 4 + quads)
                rnd = tl.reshape(
                    tl.join(tl.join(r0, r1), tl.join(r2, r3)), (BLOCK_V,)
                )  # column 4q + k: r_k[q]
            else:
                rnd = tl.rand(seed, base + cols)
            g = -tl.log(-tl.log(rnd))  # U = 0 gives -inf: never drawn
            score = tl.where(live, l + g, float("-inf"))
            better = score > gm  # strict: a lane keeps its first index on a tie
            gi = tl.where(better, cols, gi)
            gm = tl.where(better, score, gm)
    if LANE_MAX:  # each lane's maximum over its own logits: the top-k threshold (`_top_k`)
        tl.store(lane_max_ptr + (row * CHUNKS + c) * BLOCK_V + lanes, m)
    if LANE_SUM:  # and its sum of exp(l - m): the inverse-CDF draw's lanes (`softmax_invcdf`)
        tl.store(lane_sum_ptr + (row * CHUNKS + c) * BLOCK_V + lanes, s)
    m_r, s_r, u_r, i_r = _reduce_lanes(m, s, u, idx)
    out = row * CHUNKS + c
    tl.store(pm_ptr + out, m_r)
    tl.store(ps_ptr + out, s_r)
    tl.store(pu_ptr + out, u_r)
    tl.store(pi_ptr + out, i_r)
    if SAMPLE:
        g_r = tl.max(gm, axis=0)
        tl.store(pg_ptr + out, g_r)
        tl.store(pgi_ptr + out, tl.min(tl.where(gm == g_r, gi, 2147483647), axis=0))


@triton.jit
def _softmax_stats_final_kernel(
    pm_ptr,
    ps_ptr,
    pu_ptr,
    pi_ptr,
    pg_ptr,
    pgi_ptr,
    seed_ptr,
    conf_ptr,
    arg_ptr,
    ent_ptr,
    draw_ptr,
    noise_ptr,
    V,
    GROUP,
    CHUNKS: tl.constexpr,
    SAMPLE: tl.constexpr,
    GUMBEL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    if GUMBEL:  # slices in fixed order, ties to the lower index (slices are in vocabulary order)
        g = tl.load(pg_ptr + row * CHUNKS)
        gi = tl.load(pgi_ptr + row * CHUNKS)
        for c in tl.static_range(1, CHUNKS):
            g2 = tl.load(pg_ptr + row * CHUNKS + c)
            gi = tl.where(g2 > g, tl.load(pgi_ptr + row * CHUNKS + c), gi)
            g = tl.maximum(g, g2)
        tl.store(draw_ptr + row, gi.to(tl.int64))
    if SAMPLE:
        # the renoise token: counters past the group's GROUP x V used by the draws
        seed = tl.load(seed_ptr + row // GROUP)
        r = tl.randint(seed, (GROUP * V + row % GROUP).to(tl.int32)).to(tl.uint32)
        tl.store(noise_ptr + row, (r % V.to(tl.uint32)).to(tl.int64))
    m = tl.load(pm_ptr + row * CHUNKS)
    s = tl.load(ps_ptr + row * CHUNKS)
    u = tl.load(pu_ptr + row * CHUNKS)
    i = tl.load(pi_ptr + row * CHUNKS)
    for c in tl.static_range(1, CHUNKS):
        m, s, u, i = _merge(
            m,
            s,
            u,
            i,
            tl.load(pm_ptr + row * CHUNKS + c),
            tl.load(ps_ptr + row * CHUNKS + c),
            tl.load(pu_ptr + row * CHUNKS + c),
            tl.load(pi_ptr + row * CHUNKS + c),
        )
    tl.store(conf_ptr + row, 1.0 / s)
    tl.store(arg_ptr + row, i.to(tl.int64))
    tl.store(ent_ptr + row, tl.log(s) - u / s)


def _num_chunks(rows: int, vocab: int, block_v: int) -> int:
    # enough programs to fill the GPU (~4 per SM on an H200) when rows are few; powers of two only so
    # the number of compiled variants stays small
    want = max(1, triton.cdiv(512, max(rows, 1)))
    most = max(1, vocab // (4 * block_v))
    return min(triton.next_power_of_2(want), triton.next_power_of_2(most))


def softmax_argmax_launch(logits: torch.Tensor, temperature: float = 1.0, block_v: int = 2048):
    assert temperature > 0
    inv = torch.full((1,), 1.0 / float(temperature), dtype=torch.float32, device=logits.device)
    conf, arg, ent, _, _, _ = _launch(logits, inv, None, max(1, logits.shape[0]), block_v)
    return conf, arg, ent


RAND4 = True  # Philox per 4 columns (`tl.rand4x`) in the draws; False: one Philox call per column


def softmax_sample_launch(
    logits: torch.Tensor,
    inv_temp: torch.Tensor,
    seeds: torch.Tensor,
    group: int,
    top_k: int = 0,
    block_v: int = 2048,
    rand4: bool | None = None,
    cap: float | None = None,
    draw: str = "gumbel",
) -> SampleStats:
    assert logits.shape[0] == inv_temp.numel() * group == seeds.numel() * group
    assert group * logits.shape[1] + group < 2**31, "Philox counters are 32-bit"
    inv_temp = inv_temp.float().contiguous()
    conf, arg, ent, drawn, noise, lane_max = _launch(
        logits,
        inv_temp,
        seeds.long().contiguous(),
        group,
        block_v,
        lane_max=top_k > 0,
        rand4=RAND4 if rand4 is None else rand4,
        cap=cap,
        invcdf=invcdf_rule(draw),
    )
    top = top_k_scaled(logits, inv_temp, group, top_k, lane_max, cap=cap) if top_k > 0 else (None, None)
    return SampleStats(conf, arg, ent, drawn, noise, *top)


def _launch(
    logits,
    inv_temp,
    seeds,
    group: int,
    block_v: int,
    lane_max: bool = False,
    rand4: bool = False,
    cap: float | None = None,
    invcdf: bool = False,
):
    """Both passes: per-(row, slice) partials, then their merge per row; the outputs and the lane
    maxima. `invcdf`: the draw by inverse CDF (`softmax_invcdf`) in place of the Gumbel-max draw."""
    assert logits.dim() == 2 and logits.stride(-1) == 1
    assert logits.dtype in (torch.float32, torch.float16, torch.bfloat16)
    R, V = logits.shape
    sample = seeds is not None
    inverse = sample and invcdf  # the draw by `draw_invcdf` after both passes, not Gumbel's in them
    gumbel, lanes = sample and not invcdf, lane_max or inverse
    block_v = min(block_v, triton.next_power_of_2(V))
    chunks = _num_chunks(R, V, block_v)
    chunk = triton.cdiv(triton.cdiv(V, chunks), block_v) * block_v
    parts, lm = _partials(R, chunks, block_v, logits.device, gumbel, lanes)
    ls = lane_sums(R, chunks, block_v, logits.device) if inverse else lm
    conf, arg, ent, draw, noise = _outputs(R, logits.device, sample)
    if R == 0:
        return conf, arg, ent, draw, noise, lm
    seed_arg = seeds if sample else arg  # an unread placeholder without sampling
    _softmax_stats_partial_kernel[(R, chunks)](
        logits,
        *parts,
        inv_temp,
        seed_arg,
        lm,
        ls,
        V,
        logits.stride(0),
        group,
        *cap_args(cap),
        CHUNKS=chunks,
        CHUNK=chunk,
        BLOCK_V=block_v,
        SAMPLE=gumbel,
        LANE_MAX=lanes,
        LANE_SUM=inverse,
        RAND4=gumbel and rand4 and block_v >= 4,
        SOFTCAP=bool(cap),
        INTERPRETED=interpreted(_softmax_stats_partial_kernel),
        num_warps=8 if block_v >= 2048 else 4,
    )
    outs = (conf, arg, ent, draw if sample else arg, noise if sample else arg)
    _softmax_stats_final_kernel[(R,)](
        *parts, seed_arg, *outs, V, group, CHUNKS=chunks, SAMPLE=sample, GUMBEL=gumbel, num_warps=1
    )
    if inverse:
        draw_invcdf(
            logits, parts[0], parts[1], lm, ls, inv_temp, seeds, draw, group, chunks, chunk, block_v, cap
        )
    return conf, arg, ent, draw, noise, lm


def _partials(R: int, chunks: int, block_v: int, dev, sample: bool, lane_max: bool):
    """Stage 1's (max, sum, u, argmax[, draw max, draw index]) per (row, slice) and the lane maxima."""
    pm = torch.empty(R, chunks, dtype=torch.float32, device=dev)
    ps, pu = torch.empty_like(pm), torch.empty_like(pm)
    pi = torch.empty(R, chunks, dtype=torch.int32, device=dev)
    pg, pgi = (torch.empty_like(pm), torch.empty_like(pi)) if sample else (pm, pi)
    lm = torch.empty(R, chunks * block_v, dtype=torch.float32, device=dev) if lane_max else pm
    return (pm, ps, pu, pi, pg, pgi), lm


def _outputs(R: int, dev, sample: bool):
    """conf, argmax, entropy [R] and, when sampling, draw and renoise [R]."""
    conf = torch.empty(R, dtype=torch.float32, device=dev)
    ent = torch.empty_like(conf)
    arg = torch.empty(R, dtype=torch.int64, device=dev)
    draw, noise = (torch.empty_like(arg), torch.empty_like(arg)) if sample else (None, None)
    return conf, arg, ent, draw, noise


def softmax_argmax_reference(logits: torch.Tensor, temperature: float = 1.0):
    """Twin. Bytes: the naive path reads logits, writes and rereads an fp32 [R, V] probability matrix."""
    lf = logits.float() / temperature
    logp = torch.log_softmax(lf, dim=-1)
    p = logp.exp()
    conf, _ = p.max(dim=-1)
    arg = lf.argmax(dim=-1)
    ent = -(p * torch.where(p > 0, logp, torch.zeros_like(logp))).sum(-1)
    return conf, arg, ent


def softmax_argmax(logits: torch.Tensor, temperature: float = 1.0, impl: str = "auto"):
    """logits [R, V] -> (conf [R] fp32, argmax [R] int64, entropy [R] fp32); see module docstring."""
    if impl == "auto":
        impl = "triton" if auto_triton(logits, _softmax_stats_partial_kernel) else "torch"
    if impl == "triton":
        return softmax_argmax_launch(logits, temperature)
    if impl == "torch":
        return softmax_argmax_reference(logits, temperature)
    raise ValueError(f"unknown impl {impl!r}")


def softmax_sample_reference(
    logits: torch.Tensor,
    inv_temp: torch.Tensor,
    seeds: torch.Tensor,
    group: int,
    top_k: int = 0,
    cap: float | None = None,
) -> SampleStats:
    """Twin in distribution (not in draws: torch's generator is not Philox-by-counter): per group a CPU
    generator seeded with its seed draws Gumbel noise for the sample and a uniform renoise token."""
    V = logits.shape[1]
    if cap:
        logits = logits.float().div(cap).tanh_().mul_(cap)  # a copy: the caller's rows stay as they are
    lf = logits.float() * inv_temp.float().to(logits.device).repeat_interleave(group)[:, None]
    conf, arg, ent = softmax_argmax_reference(lf)
    draws, noises = [], []
    for gi, seed in enumerate(seeds.tolist()):
        g = torch.Generator().manual_seed(int(seed) % 2**63)
        u = torch.rand(group, V, generator=g, dtype=torch.float64).clamp_min(1e-300).to(logits.device)
        draws.append((lf[gi * group : (gi + 1) * group] - (-u.log()).log()).argmax(-1))
        noises.append(torch.randint(0, V, (group,), generator=g).to(logits.device))
    top = torch.topk(lf, top_k, dim=-1) if top_k > 0 else (None, None)
    return SampleStats(conf, arg, ent, torch.cat(draws), torch.cat(noises), *top)


def softmax_sample(
    logits: torch.Tensor,
    inv_temp: torch.Tensor,
    seeds: torch.Tensor,
    group: int,
    top_k: int = 0,
    impl: str = "auto",
    rand4: bool | None = None,
    cap: float | None = None,
    draw: str = "gumbel",
) -> SampleStats:
    """logits [R, V]; rows in groups of `group` consecutive rows, group g at inverse temperature
    inv_temp[g] with Philox seed seeds[g] (int64) -> `SampleStats`: the statistics of
    softmax(logits * inv_temp) as `softmax_argmax`, one draw from it and one uniform renoise token per
    row, and with `top_k` the k largest scaled logits and their ids (self-conditioning). One read of
    the logits, one more for the top k; see the module docstring. `cap`: `logits` is the LM head's
    output before its final soft cap (bf16), which both reads apply (no capped fp32 copy is written).
    `draw`: "gumbel" (Gumbel-max in the statistics read) or "invcdf" (`softmax_invcdf`: one uniform
    per row over the sums that read keeps, then one lane's logits read again)."""
    if impl == "auto":
        impl = "triton" if auto_triton(logits, _softmax_stats_partial_kernel) else "torch"
    if impl == "triton":
        return softmax_sample_launch(logits, inv_temp, seeds, group, top_k, rand4=rand4, cap=cap, draw=draw)
    if impl == "torch":
        return softmax_sample_reference(logits, inv_temp, seeds, group, top_k, cap)
    raise ValueError(f"unknown impl {impl!r}")


def compile_specs():
    """Both passes over bf16 logits at the real vocabulary, with and without the draws
    (benchmarks/kernels/compile_check.py)."""
    from .compile_spec import CompileSpec

    f32, i32 = "*fp32", "*i32"
    partials = {"pm_ptr": f32, "ps_ptr": f32, "pu_ptr": f32, "pi_ptr": i32, "pg_ptr": f32, "pgi_ptr": i32}
    partials["seed_ptr"] = "*i64"
    # (Gumbel draws, soft cap on read, lane sums: the inverse-CDF draw's statistics pass)
    for sample, softcap, sums in ((0, 0, 0), (1, 0, 0), (1, 1, 0), (0, 1, 1)):
        name = "softmax_invcdf_partial" if sums else "softmax_sample_partial" if sample else "softmax_partial"
        yield CompileSpec(
            name + ("_softcap" if softcap else ""),
            _softmax_stats_partial_kernel,
            {
                "CHUNKS": 2,
                "CHUNK": 131072,
                "BLOCK_V": 2048,
                "SAMPLE": bool(sample),
                "LANE_MAX": bool(sample or sums),
                "LANE_SUM": bool(sums),
                "RAND4": bool(sample),
                "SOFTCAP": bool(softcap),
                "INTERPRETED": False,
            },
            types={
                **partials,
                "inv_temp_ptr": "*fp32",
                "lane_max_ptr": "*fp32",
                "lane_sum_ptr": "*fp32",
                "inv_cap": "fp32",
                "cap": "fp32",
            },
            divisible=frozenset({"logits_ptr", "V", "stride_r"}),
            num_warps=8,
        )
        if softcap:
            continue  # the final pass reads no logits
        yield CompileSpec(
            "softmax_sample_final" if sample else "softmax_final",
            _softmax_stats_final_kernel,
            {"CHUNKS": 2, "SAMPLE": bool(sample), "GUMBEL": bool(sample)},
            types={
                **partials,
                "conf_ptr": "*fp32",
                "arg_ptr": "*i64",
                "ent_ptr": "*fp32",
                "draw_ptr": "*i64",
                "noise_ptr": "*i64",
            },
            num_warps=1,
        )
