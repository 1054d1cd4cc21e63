"""Launchers and the public `w4_moe`: routing alignment, then one table-driven launcher per kernel family
(Triton on K-contiguous packs, Gluon on tiled ones) for the two matmuls, then the combine.

Letters as in `kernels.py`: T tokens, K top-k, A = T*K, P padded rows, E experts, H hidden, I expert width.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton

from .._dispatch import auto_triton, can_launch, interpreted, pdl_kwargs
from . import kernels as _k
from .config import MoeLaunchConfig, get_config, triton_constexprs
from .quant import W4Experts


@dataclass(frozen=True)
class RoutingMeta:
    """Assignments sorted by expert and padded to BLOCK_M-row blocks (see `kernels.py`)."""

    sorted_ids: torch.Tensor  # [P_max] int32, assignment id t*K + k, sentinel A on padding rows
    block_expert: torch.Tensor  # [P_max / BLOCK_M] int32 (beyond num_padded: clamped, unused)
    num_padded: torch.Tensor  # [1] int32, P = sum over experts of round_up(count, BLOCK_M)
    counts: torch.Tensor  # [E] int32 assignments per expert
    num_assign: int  # A
    block_m: int


@dataclass(frozen=True)
class ExpertRows:
    """The routed experts' output before its combine (`w4_moe(..., defer_combine=True)`): the
    per-assignment rows and the routing that weights them. The end-of-layer norm reads these directly
    (`norm_residual.add_rms_norm`), one launch and one [T, H] round trip fewer than combining first;
    `combined()` is the combine in torch (`reference.combine_reference`)."""

    y_tk: torch.Tensor  # [T*K, H], row t*K + k: expert ids[t, k]'s output for token t (unweighted)
    weights: torch.Tensor  # [T, K] combine weights, or the router's raw top-k probabilities (expert_scale)
    ids: torch.Tensor  # [T, K] int
    expert_scale: torch.Tensor | None  # [E]: weights are renormalised and scaled (`route_weights`)
    # [T*K] int64: y_tk's row for assignment t*K + k when the rows stay in expert order (FP8 experts)
    row_map: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return (self.ids.shape[0], self.y_tk.shape[1])

    def combined(self) -> torch.Tensor:
        from .reference import combine_reference, route_weights

        w = self.weights
        if self.expert_scale is not None:
            w = route_weights(w, self.ids, self.expert_scale)
        return combine_reference(self.y_tk if self.row_map is None else self.y_tk[self.row_map], w)


def max_padded_rows(num_assign: int, num_experts: int, block_m: int) -> int:
    """Upper bound on P: each non-empty expert wastes < BLOCK_M rows, at most min(E, A) are non-empty."""
    nonempty = min(num_experts, num_assign)
    return triton.cdiv(num_assign + nonempty * (block_m - 1), block_m) * block_m


MAX_CHUNKS = 64  # every align program sums all chunks' histograms: keep that loop short
HIST_ROWS = 16  # histogram rows the align kernel sums per step


def align_routing(topk_ids: torch.Tensor, num_experts: int, block_m: int = 32) -> RoutingMeta:
    """topk_ids [T, K] -> RoutingMeta: a counting sort in two Triton kernels (per-chunk histograms,
    then slots), no global sort, no host sync, no atomics. (The pure-torch twin, ~25 small launches,
    is `align_routing_reference`; both give identical metadata.)"""
    assert topk_ids.dim() == 2
    if not can_launch(topk_ids, _k._align_kernel):
        return align_routing_reference(topk_ids, num_experts, block_m)
    dev = topk_ids.device
    A = topk_ids.numel()
    assert 0 < A < 2**30 and num_experts <= 4096
    ids = topk_ids.reshape(-1).contiguous()
    e_p2 = triton.next_power_of_2(num_experts)
    sub = max(block_m, 32)  # one-hot tiles [sub, E]: 32 rows x 128 experts compile without spills
    chunk = max(sub, triton.next_power_of_2(triton.cdiv(A, MAX_CHUNKS)))
    num_chunks = triton.cdiv(A, chunk)
    p_max = max_padded_rows(A, num_experts, block_m)
    hist = torch.empty(num_chunks, e_p2, dtype=torch.int32, device=dev)
    sorted_ids = torch.empty(p_max, dtype=torch.int32, device=dev)
    block_expert = torch.empty(p_max // block_m, dtype=torch.int32, device=dev)
    num_padded = torch.empty(1, dtype=torch.int32, device=dev)
    counts = torch.empty(num_experts, dtype=torch.int32, device=dev)
    warps = 4
    _k._histogram_kernel[(num_chunks,)](
        ids,
        hist,
        A,
        E_P2=e_p2,
        CHUNK=chunk,
        SUB=sub,
        **pdl_kwargs(ids, _k._histogram_kernel),
        num_warps=warps,
    )
    _k._align_kernel[(triton.cdiv(p_max, chunk),)](
        ids,
        hist,
        sorted_ids,
        block_expert,
        num_padded,
        counts,
        A,
        num_experts,
        num_chunks,
        p_max,
        BLOCK_M=block_m,
        E_P2=e_p2,
        CHUNK=chunk,
        SUB=sub,
        HIST_ROWS=HIST_ROWS,
        HIST_STEPS=triton.cdiv(num_chunks, HIST_ROWS),
        **pdl_kwargs(ids, _k._align_kernel),
        num_warps=warps,
    )
    return RoutingMeta(sorted_ids, block_expert, num_padded, counts, A, block_m)


def align_routing_reference(topk_ids: torch.Tensor, num_experts: int, block_m: int = 32) -> RoutingMeta:
    """Twin of `align_routing` in torch ops (stable sort, searchsorted, cumsum, index_put)."""
    assert topk_ids.dim() == 2
    dev = topk_ids.device
    A = topk_ids.numel()
    flat = topk_ids.reshape(-1).to(torch.int64)
    sorted_e, order = torch.sort(flat, stable=True)
    bounds = torch.searchsorted(sorted_e, torch.arange(num_experts + 1, device=dev))
    counts = bounds[1:] - bounds[:-1]  # [E]
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = torch.cumsum(padded, 0)
    pad_start = pad_end - padded
    rank = torch.arange(A, device=dev) - bounds[:-1][sorted_e]
    dest = pad_start[sorted_e] + rank
    p_max = max_padded_rows(A, num_experts, block_m)
    sorted_ids = torch.full((p_max,), A, dtype=torch.int32, device=dev)
    sorted_ids[dest] = order.to(torch.int32)
    block_start = torch.arange(0, p_max, block_m, device=dev)
    block_expert = torch.searchsorted(pad_end, block_start, right=True).clamp_(max=num_experts - 1)
    return RoutingMeta(
        sorted_ids=sorted_ids,
        block_expert=block_expert.to(torch.int32),
        num_padded=pad_end[-1:].to(torch.int32),
        counts=counts.to(torch.int32),
        num_assign=A,
        block_m=block_m,
    )


@dataclass(frozen=True)
class _Matmul:
    """What tells the two W4 matmuls apart for their launchers. `name` prefixes the pack's tensors
    (`<name>_q`, `_scale`, `_zero`, `_sz`), its group (`config.group_<name>`) and the config's tile fields."""

    name: str
    k_width: str  # W4Experts attribute: the reduced width
    n_width: str  # W4Experts attribute: the output columns
    by_token: bool  # reads x[t] of an assignment t*K + k (gate_up), else its sorted row of h (down)


MATMULS = {
    "gate_up": _Matmul("gate_up", "hidden", "inter", by_token=True),
    "down": _Matmul("down", "inter", "hidden", by_token=False),
}


def _out_shape(mm: _Matmul, meta: RoutingMeta, packed: W4Experts) -> tuple[int, int]:
    rows = meta.sorted_ids.numel() if mm.by_token else meta.num_assign
    return (rows, getattr(packed, mm.n_width))


def _launch_triton(
    mm: _Matmul,
    a: torch.Tensor,
    packed: W4Experts,
    meta: RoutingMeta,
    cfg: MoeLaunchConfig,
    out: torch.Tensor,
) -> None:
    assert not packed.tiled, "a tiled pack is read by the Gluon kernels"
    assert out.shape == _out_shape(mm, meta, packed) and out.dtype == a.dtype and out.stride(-1) == 1
    kernel = getattr(_k, f"_w4_{mm.name}_kernel")
    q, s, z = (getattr(packed, f"{mm.name}_{t}") for t in ("q", "scale", "zero"))
    group = getattr(packed.config, f"group_{mm.name}")
    n = getattr(packed, mm.n_width)
    consts = triton_constexprs(
        mm.name, cfg, group, s.shape[1], getattr(packed, mm.k_width), a.dtype, not interpreted(kernel)
    )
    by_token = (meta.num_assign // a.shape[0],) if mm.by_token else ()
    kernel[(meta.sorted_ids.numel() // cfg.block_m, triton.cdiv(n, consts["BLOCK_N"]))](
        a, q, s, z, out, meta.sorted_ids, meta.block_expert, meta.num_padded, meta.num_assign, *by_token,
        packed.hidden, packed.inter, a.stride(0), q.stride(0), q.stride(1), s.stride(0), s.stride(1),
        out.stride(0), **consts, **pdl_kwargs(a, kernel),
        num_warps=getattr(cfg, f"{mm.name}_warps"), num_stages=getattr(cfg, f"{mm.name}_stages"),
    )  # fmt: skip


def _launch_gluon(
    mm: _Matmul,
    a: torch.Tensor,
    packed: W4Experts,
    meta: RoutingMeta,
    cfg: MoeLaunchConfig,
    out: torch.Tensor,
) -> None:
    from . import gluon_w4

    assert packed.tiled and out.shape == _out_shape(mm, meta, packed) and out.dtype == a.dtype
    assert out.is_contiguous() and a.stride(-1) == 1
    assert a.stride(0) % 2 == 0 and a.data_ptr() % 4 == 0, "activations are read as 32-bit pairs"
    kernel = getattr(gluon_w4, f"_gl_w4_{mm.name}_kernel")
    qt, sz = getattr(packed, f"{mm.name}_q"), getattr(packed, f"{mm.name}_sz")
    n = getattr(packed, mm.n_width)
    warps, tiles, stages, maxnreg = (
        getattr(cfg, f"gluon_{mm.name}_{t}") for t in ("warps", "tiles", "stages", "maxnreg")
    )
    nw, tiles = gluon_tile(warps, tiles, n)
    bn = 16 * nw * tiles
    cap = {} if maxnreg is None else {"maxnreg": maxnreg}  # ptxas register cap
    by_token = (meta.num_assign // a.shape[0], packed.inter) if mm.by_token else ()
    kernel[(meta.sorted_ids.numel() // meta.block_m, n // bn)](
        a, qt, sz, out, meta.sorted_ids, meta.block_expert, meta.num_padded, meta.num_assign, *by_token,
        a.stride(0), qt.stride(0), sz.stride(0), sz.stride(1), out.stride(0),
        GROUP=getattr(packed.config, f"group_{mm.name}"), NUM_GROUPS=sz.shape[1], BLOCK_M=meta.block_m,
        BN=bn, NW=nw, STAGES=stages, **pdl_kwargs(a, kernel), **cap, num_warps=nw,
    )  # fmt: skip


def launch_matmul(
    which: str, a: torch.Tensor, packed: W4Experts, meta: RoutingMeta, cfg: MoeLaunchConfig, out: torch.Tensor
) -> None:
    """One W4 matmul over the sorted rows, through the Gluon kernel on a tiled pack, else the Triton one.
    "gate_up": out = h [P_max, I], act(x[tok] @ gate^T) * (x[tok] @ up^T) per sorted row (padding rows:
    zeros); "down": a = h, out = y_tk [A, H], row t*K + k = h[row of (t, k)] @ down_e^T (unweighted; the
    combine weights it)."""
    (_launch_gluon if packed.tiled else _launch_triton)(MATMULS[which], a, packed, meta, cfg, out)


LAYOUT_ENV = "CANVASQ_MOE_LAYOUT"  # "kcontig": keep the K-contiguous packing (Triton kernels) on CUDA too


def tiled_runnable(packed: W4Experts, dtype: torch.dtype) -> bool:
    """Whether the Gluon kernels can serve every call on `packed` with `dtype` activations: compiled
    on a CUDA device, fp16/bf16 with scales of that dtype, no padded groups, whole 16-row tiles."""
    gg, gd = packed.config.group_gate_up, packed.config.group_down
    return (
        packed.device.type == "cuda"
        and not interpreted(_k._w4_gate_up_kernel)
        and packed.scale_dtype == dtype
        and packed.tiling_problem() is None
        and gg in (64, 128)  # the groups the kernels take (the layout takes any power of two >= 64)
        and gd in (64, 128)
    )


def tiled_supported(packed: W4Experts, dtype: torch.dtype) -> bool:
    """`tiled_runnable`, unless switched off with CANVASQ_MOE_LAYOUT=kcontig."""
    return os.environ.get(LAYOUT_ENV, "tiled") != "kcontig" and tiled_runnable(packed, dtype)


def prefer_tiled(packed: W4Experts, dtype: torch.dtype | None = None) -> W4Experts:
    """`packed.to_tiled()` where `tiled_supported` (the Gluon kernels are the faster pair: BENCHMARKS.md,
    "W4 MoE layer"; the K-contiguous bytes are then dropped, so expert memory stays one copy), else
    `packed`."""
    return packed.to_tiled() if tiled_supported(packed, dtype or packed.scale_dtype) else packed


def gluon_tile(warps: int, tiles: int, n: int) -> tuple[int, int]:
    """(warps, tiles) of a config, narrowed until 16 * warps * tiles divides the n output columns."""
    while n % (16 * warps * tiles):
        if tiles > 1:
            tiles //= 2
        else:
            warps //= 2
    return warps, tiles


def routing_block(cfg: MoeLaunchConfig, packed: W4Experts) -> int:
    """BLOCK_M of the kernels that will run: the Gluon one on a tiled pack, else the Triton one."""
    return (cfg.gluon_block_m or cfg.block_m) if packed.tiled else cfg.block_m


def _check_tiled(x: torch.Tensor, packed: W4Experts) -> None:
    if not tiled_runnable(packed, x.dtype):
        raise ValueError(
            f"this pack is tiled for the Gluon kernels, which need compiled CUDA and fp16/bf16 activations "
            f"in the scales' dtype ({packed.scale_dtype}); got {x.dtype} on {x.device}. Run the torch twin "
            f"(impl='torch') or keep the pack K-contiguous (CANVASQ_MOE_LAYOUT=kcontig)"
        )


def w4_moe_launch(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    packed: W4Experts,
    config: MoeLaunchConfig | None = None,
    out: torch.Tensor | None = None,
    routing: RoutingMeta | None = None,
    expert_scale: torch.Tensor | None = None,
    combine: bool = True,
) -> torch.Tensor | ExpertRows:
    """Kernel path (Triton kernels on a K-contiguous pack, Gluon on a tiled one, `prefer_tiled`).
    x [T, H] fp16/bf16/fp32, topk_ids [T, K] int, topk_weights [T, K] -> out [T, H] x.dtype.
    `expert_scale` [E]: see `w4_moe`. combine=False: the uncombined `ExpertRows` instead of out."""
    T, H = x.shape
    K = topk_ids.shape[1]
    E, I = packed.num_experts, packed.inter
    assert H == packed.hidden, (H, packed.hidden)
    assert topk_ids.shape == topk_weights.shape == (T, K)
    assert x.device == topk_ids.device == topk_weights.device == packed.device
    assert x.dtype in (torch.float16, torch.bfloat16, torch.float32)
    assert x.stride(-1) == 1
    assert x.stride(0) * T < 2**31, "kernels use int32 offsets into x"
    cfg = config or get_config(T, K, packed, x.dtype)
    if out is None:
        out = torch.empty_like(x)
    assert out.shape == (T, H) and out.stride(-1) == 1
    if T == 0:
        return out
    block_m = routing_block(cfg, packed)
    meta = routing or align_routing(topk_ids, E, block_m)
    assert meta.block_m == block_m and meta.num_assign == T * K
    p_max = meta.sorted_ids.numel()
    assert p_max * I < 2**31, "kernels use int32 offsets into h"
    weights = topk_weights.contiguous()

    h = torch.empty(p_max, I, dtype=x.dtype, device=x.device)
    y_tk = torch.empty(T * K, H, dtype=x.dtype, device=x.device)
    if packed.tiled:
        _check_tiled(x, packed)
        if x.stride(0) % 2 or x.data_ptr() % 4:  # the Gluon kernels read activations as 32-bit pairs
            x = x.clone(memory_format=torch.contiguous_format)
    launch_matmul("gate_up", x, packed, meta, cfg, h)
    launch_matmul("down", h, packed, meta, cfg, y_tk)
    if expert_scale is not None:
        assert expert_scale.shape == (E,) and expert_scale.device == x.device
    rows = ExpertRows(y_tk, weights, topk_ids.contiguous(), expert_scale)
    return combine_rows(rows, out, cfg.combine_block_n) if combine else rows


def combine_rows(rows: ExpertRows, out: torch.Tensor | None = None, block_n: int = 1024) -> torch.Tensor:
    """The experts' combine in one launch (`kernels._combine_kernel`): out [T, H] in the rows' dtype."""
    (T, H), K = rows.shape, rows.ids.shape[1]
    out = torch.empty(T, H, dtype=rows.y_tk.dtype, device=rows.y_tk.device) if out is None else out
    assert out.shape == (T, H) and out.stride(-1) == 1 and rows.y_tk.stride(-1) == 1
    bn = min(block_n, triton.next_power_of_2(H))
    renorm = rows.expert_scale is not None
    _k._combine_kernel[(T, triton.cdiv(H, bn))](
        rows.y_tk,
        rows.weights,
        rows.ids,
        rows.expert_scale if renorm else rows.weights,
        out,
        H,
        rows.y_tk.stride(0),
        out.stride(0),
        TOP_K=K,
        K_P2=triton.next_power_of_2(K),
        RENORM=renorm,
        BLOCK_N=bn,
        **pdl_kwargs(rows.y_tk, _k._combine_kernel),
    )
    return out


def w4_moe(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    packed: W4Experts,
    impl: str = "auto",
    expert_scale: torch.Tensor | None = None,
    defer_combine: bool = False,
) -> torch.Tensor | ExpertRows:
    """Routed experts in W4A16: y[t] = sum_k w[t,k] * down_e(act(gate_e(x[t])) * up_e(x[t])), e = ids[t,k].

    x [T, H], topk_ids [T, K], topk_weights [T, K] -> [T, H] in x.dtype. With `expert_scale` [E] the
    weights are the router's raw top-k probabilities and w = p / sum_k p * expert_scale[e]
    (`route_weights`, DiffusionGemma's router epilogue), applied inside the combine. `impl`: "triton", "torch"
    (the dequantised twin) or "auto" (Triton on CUDA, or on CPU when the kernels were imported under
    TRITON_INTERPRET=1 and it is still set; otherwise the twin; see `canvasq.kernels._dispatch`).
    `defer_combine`: on the kernel path, return the uncombined `ExpertRows` (the twin always combines).
    """
    if impl == "auto":
        usable = auto_triton(x, _k._w4_gate_up_kernel) and (
            not packed.tiled or tiled_runnable(packed, x.dtype)
        )
        impl = "triton" if usable else "torch"
    if impl == "triton":
        return w4_moe_launch(
            x, topk_ids, topk_weights, packed, expert_scale=expert_scale, combine=not defer_combine
        )
    if impl == "torch":
        from .reference import w4_moe_reference

        return w4_moe_reference(x, topk_ids, topk_weights, packed, expert_scale)
    raise ValueError(f"unknown impl {impl!r}: expected 'auto', 'triton' or 'torch'")
