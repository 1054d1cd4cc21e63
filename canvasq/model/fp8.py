"""FP8 (e4m3) GEMMs for large forwards: where a forward has thousands of rows, it is compute-bound,
and Hopper's FP8 tensor cores double the bf16 peak. W4A16 saves bytes, not FLOPs, so it stays the
path for small forwards (and for GPUs without FP8 grouped GEMMs, e.g. sm_121).

Scales: weights per output channel (one fp32 scale per row of W [N, K], per expert for the experts),
activations per row, computed on the fly from the row's absolute maximum. Both are dequantisation
multipliers (w ≈ q * scale), the convention of `torch._scaled_mm` / `torch._scaled_grouped_mm`.

The experts' FP8 copy is made from whatever the runtime holds: the BF16 experts, or, where those were
freed at load (W4 packing), the W4 pack dequantised (`from_w4`), so a worker needs no extra load-time
step and the disk cache stays the W4 one.

On CUDA with sm >= 9.0 the GEMMs are torch's FP8 kernels (row-wise scaling, fast accumulation), the
experts' through `kernels.fp8_grouped` where this GPU has its tuned tilings (CANVASQ_FP8_GROUPED); on any
other device `fp8_linear` / `fp8_moe` dequantise and run the model-dtype matmul, the same numbers up
to accumulation order (the CPU tests compare the two paths through this twin).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from canvasq.model.experts import gelu_tanh

if TYPE_CHECKING:
    from canvasq.kernels.moe.w4a8 import W4A8Matrix

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
_TINY = 1e-12  # an all-zero row still gets a finite scale

# parts of a forward that can run in FP8 (CANVASQ_FP8 lists them)
PARTS = ("experts", "dense", "head")  # = decoders.configs.FP8_PARTS (a test holds them equal)


def fp8_supported(device: torch.device | str) -> bool:
    """torch's FP8 GEMMs with row-wise scales (and the grouped one) run on sm 9.x (Hopper)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return _hopper(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=16)
def _hopper(index: int) -> bool:
    major, _ = torch.cuda.get_device_capability(index)
    return major == 9 and hasattr(torch, "_scaled_grouped_mm") and hasattr(torch, "_scaled_mm")


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (q [..., K] e4m3, scale [...] fp32) with x ≈ q * scale, per row (saturating)."""
    amax = x.abs().amax(dim=-1, keepdim=True).float().clamp_min(_TINY)
    scale = amax / E4M3_MAX
    q = (x.float() / scale).clamp_(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return q, scale.squeeze(-1)


@dataclass
class FP8Linear:
    """W [N, K] as e4m3 with one scale per output channel."""

    q: torch.Tensor  # [N, K] e4m3
    scale: torch.Tensor  # [N] fp32

    @classmethod
    def from_weight(cls, w: torch.Tensor) -> FP8Linear:
        q, s = quantize_rows(w.detach())
        return cls(q.contiguous(), s.contiguous())

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return (self.q.float() * self.scale[:, None]).to(dtype)

    def nbytes(self) -> int:
        return self.q.numel() + 4 * self.scale.numel()


@dataclass
class FP8Experts:
    """Routed experts as e4m3 in HF's layout: gate_up [E, 2I, H], down [E, H, I]; a scale per expert
    and output channel."""

    gate_up: torch.Tensor
    gate_up_scale: torch.Tensor  # [E, 2I]
    down: torch.Tensor
    down_scale: torch.Tensor  # [E, H]
    grouped: str = "torch"  # the kernel path's grouped GEMM: GROUPED_IMPLS

    @classmethod
    def from_weights(cls, gate_up: torch.Tensor, down: torch.Tensor) -> FP8Experts:
        g, gs = _quantize_by_expert(gate_up)
        d, ds = _quantize_by_expert(down)
        return cls(g, gs, d, ds)

    @classmethod
    def from_w4(cls, packed) -> FP8Experts:
        """From a W4 pack (the BF16 experts freed at load): dequantised one expert block at a time."""
        from canvasq.kernels.moe.quant import unpack_w4

        gate_up, down = unpack_w4(packed)
        return cls.from_weights(gate_up, down)

    def nbytes(self) -> int:
        return sum(
            t.numel() * t.element_size()
            for t in (self.gate_up, self.gate_up_scale, self.down, self.down_scale)
        )

    @property
    def num_experts(self) -> int:
        return self.gate_up.shape[0]

    def rows(self, x: torch.Tensor, order, row_of, offs, kernel: bool) -> torch.Tensor:
        """Tokens x [N, H] -> their K experts' outputs [N*K, H] in expert order (`expert_order`'s
        order, row_of [N, K] and offs): each token quantised once, its rows gathered per assignment
        (the scale travels with the row), the gated activation quantised from the gate/up output."""
        if kernel:  # each token quantised once, its copies written straight to their expert-order rows
            from canvasq.kernels.fp8_quant import quantize_rows_triton

            xq, xs = quantize_rows_triton(x.contiguous(), dest=row_of)
        else:
            xq, xs = quantize_rows(x)
            src = order // row_of.shape[1]
            xq, xs = (
                xq.view(torch.uint8)[src].view(E4M3),
                xs[src],
            )  # as bytes: fp8 indexing is not on every build
        aq, as_ = _gated_rows(xq, xs, self, offs, x.dtype, kernel)
        return _grouped(aq, as_, self.down, self.down_scale, offs, x.dtype, kernel, self.grouped)


@dataclass
class W4A8Experts:
    """The W4 pack's own weights for `fp8_moe` (CANVASQ_FP8_GROUPED=w4a8): the e4m3 rows against the
    pack's nibbles (`kernels.moe.w4a8.W4A8Matrix`: Hopper's wgmma kernel on the bytes in its order,
    else the Triton kernel on the K-contiguous pack), instead of an e4m3 copy of the pack. The rows are
    quantised as for `FP8Experts`, with each row's sums over the pack's groups beside them (the
    kernels' bias form). The Triton kernel measured slower than the e4m3 copy on an H100 (BENCHMARKS,
    "W4A8 measured"): an arm. Off the kernel path the twin is `FP8Experts`' on the pack dequantised to
    fp32, unit channel scales."""

    gate_up: W4A8Matrix  # [E, 2I, H]
    down: W4A8Matrix  # [E, H, I]
    copied: int = 0  # bytes made here (a reordered or untiled q); the rest is the pack's

    @classmethod
    def from_w4(cls, packed, wgmma: bool | None = None) -> W4A8Experts:
        """`wgmma` None: the wgmma kernel's order wherever it runs (`w4a8.wgmma_here`)."""
        from canvasq.kernels.moe.w4a8 import W4A8Matrix

        gq, dq = packed.kcontig_q()
        gate_up = W4A8Matrix.of(gq, packed.gate_up_scale, packed.gate_up_zero, wgmma)
        down = W4A8Matrix.of(dq, packed.down_scale, packed.down_zero, wgmma)
        made = [m.q for m in (gate_up, down) if m.q is not packed.gate_up_q and m.q is not packed.down_q]
        made += [m.scale for m in (gate_up, down) if m.wgmma]
        return cls(gate_up, down, sum(t.numel() * t.element_size() for t in made))

    @property
    def num_experts(self) -> int:
        return self.gate_up.q.shape[0]

    def nbytes(self) -> int:
        return self.copied

    def groups(self) -> tuple[int, int]:
        """(gate/up's group along H, down's along I)."""
        return self.gate_up.group, self.down.group

    def rows(self, x: torch.Tensor, order, row_of, offs, kernel: bool) -> torch.Tensor:
        """`FP8Experts.rows` on the pack: tokens x [N, H] -> [N*K, H] in expert order."""
        if not kernel:
            return self.twin().rows(x, order, row_of, offs, kernel=False)
        from canvasq.kernels.fp8_quant import gelu_mul_quant_sums, quantize_rows_sums

        g_up, g_down = self.groups()
        xq, xs, sums = quantize_rows_sums(x.contiguous(), g_up, dest=row_of)
        h = self.gate_up.gemm(xq, xs, sums, offs, x.dtype)
        aq, as_, sums = gelu_mul_quant_sums(h, g_down)
        return self.down.gemm(aq, as_, sums, offs, x.dtype)

    def twin(self) -> FP8Experts:
        """The pack dequantised to fp32 as `FP8Experts` with unit channel scales (the CPU's path)."""
        gu, dn = (_dequantized(*m.unpacked()) for m in (self.gate_up, self.down))
        return FP8Experts(gu, gu.new_ones(gu.shape[:2]), dn, dn.new_ones(dn.shape[:2]))


def _dequantized(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    from canvasq.kernels.moe.quant import dequantize_w4

    return dequantize_w4(q, scale, zero, 2 * q.shape[2]).float()


def _quantize_by_expert(w: torch.Tensor, chunk: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, N, K] -> e4m3 [E, N, K] and scales [E, N], a few experts at a time (bounded fp32 scratch)."""
    q = torch.empty(w.shape, dtype=E4M3, device=w.device)
    s = torch.empty(w.shape[:2], dtype=torch.float32, device=w.device)
    for e in range(0, w.shape[0], chunk):
        q[e : e + chunk], s[e : e + chunk] = quantize_rows(w[e : e + chunk].detach())
    return q, s


def _quantize(x: torch.Tensor, kernel: bool):
    if kernel:
        from canvasq.kernels.fp8_quant import quantize_rows_triton

        return quantize_rows_triton(x.contiguous())
    return quantize_rows(x)


def fp8_linear(x: torch.Tensor, w: FP8Linear, kernel: bool | None = None) -> torch.Tensor:
    """x [M, K] @ W.T -> [M, N] in x's dtype, x quantised per row. `kernel`: torch's FP8 GEMM and the
    Triton row quantiser (default: where `fp8_supported`) or the dequantising twin."""
    kernel = fp8_supported(x.device) if kernel is None else kernel
    xq, xs = _quantize(x, kernel)
    if kernel:
        return scaled_rows(xq, xs, w, x.dtype)
    return ((xq.float() * xs[:, None]) @ (w.q.float() * w.scale[:, None]).t()).to(x.dtype)


def scaled_rows(xq: torch.Tensor, xs: torch.Tensor, w: FP8Linear, dtype: torch.dtype) -> torch.Tensor:
    """Quantised rows (e4m3 [M, K], scales [M]) @ W.T through torch's row-scaled FP8 GEMM (rows a norm
    wrote quantised come straight here: `rmsnorm.rms_norm_quant`, `pre_ffn_norms(quant_a=True)`)."""
    return torch._scaled_mm(
        xq, w.q.t(), scale_a=xs[:, None], scale_b=w.scale[None, :], out_dtype=dtype, use_fast_accum=True
    )


def fp8_gated_linear(gu: torch.Tensor, w: FP8Linear, act=None, kernel: bool | None = None) -> torch.Tensor:
    """gelu_tanh(gate) * up of gu [M, 2I] (gate | up) @ W.T -> [M, N]: the dense MLP's down projection
    on its gate/up output. On the kernel path the activation is quantised straight from gu (one
    launch, `gelu_mul_quant`: the model-dtype activation is never written, the values `gelu_mul`
    writes); the twin applies `act` (default: `kernels.gelu_mul`'s torch twin), then quantises."""
    kernel = fp8_supported(gu.device) if kernel is None else kernel
    if not kernel:
        if act is None:
            from canvasq.kernels.gelu_mul import gelu_mul_reference as act
        return fp8_linear(act(gu), w, kernel=False)
    from canvasq.kernels.fp8_quant import gelu_mul_quant_triton

    return scaled_rows(*gelu_mul_quant_triton(gu), w, gu.dtype)


def fp8_moe(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_p: torch.Tensor,
    ex: FP8Experts | W4A8Experts,
    expert_scale: torch.Tensor | None = None,
    defer_combine: bool = False,
    kernel: bool | None = None,
):
    """`experts.moe_grouped` on per-row e4m3 activations: x [N, H] -> [N, H], the weights e4m3
    (`FP8Experts`) or the W4 pack's (`W4A8Experts`), whose `rows` run the two GEMMs.

    `topk_p` are the combine weights, or with `expert_scale` the router's raw top-k probabilities
    (renormalised and scaled by `route_weights`). With `defer_combine` the per-assignment
    rows come back in token order as the W4 path's `ExpertRows`, which the end-of-layer norm combines;
    otherwise the K outputs of a row are summed in fp32 in fixed k order, as the other
    implementations do."""
    from canvasq.kernels.moe.launch import ExpertRows
    from canvasq.kernels.moe.reference import route_weights

    kernel = fp8_supported(x.device) if kernel is None else kernel
    n, k = topk_ids.shape
    order, offs, row_of = expert_order(topk_ids, ex.num_experts, kernel)
    out = ex.rows(x, order, row_of.view(n, k), offs, kernel)  # [N*K, H], by expert
    if defer_combine:  # the combine reads the rows where they are (no scatter back to token order)
        return ExpertRows(out, topk_p, topk_ids, expert_scale, row_map=row_of)
    y = out[row_of]  # token order: row t*K + j is token t's j-th expert
    w = topk_p if expert_scale is None else route_weights(topk_p, topk_ids, expert_scale)
    y = y.view(n, k, -1).float() * w[..., None].float()
    return y.sum(1).to(x.dtype)


def _gated_rows(xq, xs, ex: FP8Experts, offs, dtype, kernel: bool):
    """The quantised gelu_tanh(gate) * up of the rows' gate/up GEMM: the grouped GEMM (`ex.grouped`'s),
    then `gelu_mul_quant`, or the twin. (Our grouped GEMM's gated epilogue, which never writes the
    [M, 2I] output, is not used: on an H100 it was slower than the plain launch and `gelu_mul_quant`,
    BENCHMARKS "Our FP8 grouped GEMM against torch's".)"""
    if kernel:
        from canvasq.kernels.fp8_quant import gelu_mul_quant_triton

        gu = _grouped(xq, xs, ex.gate_up, ex.gate_up_scale, offs, dtype, kernel, ex.grouped)
        return gelu_mul_quant_triton(gu)
    g, u = _grouped(xq, xs, ex.gate_up, ex.gate_up_scale, offs, dtype, kernel).chunk(2, dim=-1)
    return quantize_rows(gelu_tanh(g) * u)


ORDERS = ("narrow", "count", "sort", "chunks")


def expert_order(
    topk_ids: torch.Tensor, num_experts: int, kernel: bool, method: str | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The assignments t*K + j in expert order, stable ([T*K]), each expert's end in that order ([E]
    int32, the grouped GEMM's `offs`) and each assignment's place in it (`row_of`, [T*K] int64); every
    method gives the same three. `method` (default: "chunks" on the kernel path, else "sort"):
    - "sort": torch's stable sort of the int64 ids (on CUDA a radix sort: eight passes and their memsets);
    - "narrow": the same sort of the ids as one byte (E <= 255) or two, so a radix sort makes one or two
      passes; ids below E fit the narrow type, so the order is the same;
    - "count": `align_routing`'s counting sort at one-row blocks (two Triton launches, but each row
      ranked against every expert: slower than "narrow" at a loop's row counts on an H100);
    - "chunks": `kernels.expert_order`'s two launches (chunk histograms, then each chunk's keys sorted
      in registers and placed); "narrow" where they cannot take the routing. From a graph on an H100
      13.6-15.5 us against "narrow"'s 31.7-36.7 at 1,024-16,384 tokens, the same three outputs
      (BENCHMARKS "Persistent grouped GEMM, PDL, routing order and deferred heads")."""
    method = method or ("chunks" if kernel else "sort")
    if method == "chunks":
        from canvasq.kernels import expert_order as chunked
        from canvasq.kernels._dispatch import can_launch

        if can_launch(topk_ids, chunked._place) and chunked.takes(topk_ids, num_experts):
            return chunked.expert_order_chunks(topk_ids, num_experts)
        method = "narrow"
    flat = topk_ids.reshape(-1)
    arange = torch.arange(flat.numel(), device=flat.device)
    if method == "count":
        from canvasq.kernels.moe.launch import align_routing

        meta = align_routing(topk_ids, num_experts, block_m=1)
        order = meta.sorted_ids.long()
        offs = torch.cumsum(meta.counts, 0, dtype=torch.int32)
    else:
        assert method in ORDERS, method
        keys = flat.to(_key_dtype(num_experts)) if method == "narrow" else flat
        sorted_e, order = torch.sort(keys, stable=True)
        bounds = torch.arange(1, num_experts + 1, device=flat.device, dtype=keys.dtype)
        offs = torch.searchsorted(sorted_e, bounds, right=False).to(torch.int32)
    return order, offs, torch.empty_like(order).scatter_(0, order, arange)


def _key_dtype(num_experts: int) -> torch.dtype:
    """The narrowest sort key that holds the ids and the bound E (`expert_order`'s "narrow")."""
    if num_experts <= 255:
        return torch.uint8
    return torch.int16 if num_experts <= 32767 else torch.int64


def _grouped(aq, a_scale, wq, w_scale, offs, dtype, kernel: bool, impl: str = "torch"):
    """Rows sorted by expert ([M, K] e4m3, [M] scales) times their expert's W.T ([E, N, K] e4m3); on the
    kernel path through torch's grouped GEMM or ours (`impl`, GROUPED_IMPLS)."""
    if kernel and impl == "triton":
        from canvasq.kernels.fp8_grouped import grouped_gemm

        return grouped_gemm(aq, a_scale, wq, w_scale, offs, dtype)
    if kernel:
        return torch._scaled_grouped_mm(
            aq, wq.transpose(-2, -1), a_scale, w_scale, offs=offs, out_dtype=dtype, use_fast_accum=True
        )
    a = aq.float() * a_scale[:, None]
    out = torch.empty(aq.shape[0], wq.shape[1], dtype=torch.float32, device=aq.device)
    start = 0
    for e, end in enumerate(offs.tolist()):  # the CPU twin: host sync is fine here
        if end > start:
            out[start:end] = a[start:end] @ (wq[e].float() * w_scale[e][:, None]).t()
        start = end
    return out.to(dtype)


DENSE = ("wqkv", "wo", "mlp_gate_up", "mlp_down")
# CANVASQ_FP8_GROUPED: torch's `_scaled_grouped_mm`, ours (`kernels.fp8_grouped`), or the W4 pack's
# own weights against the e4m3 rows (`W4A8Experts`: no e4m3 copy of the experts)
GROUPED_IMPLS = ("torch", "triton", "w4a8")


def parse_grouped(value: str | None, device: torch.device | str = "cpu", experts: int = 128) -> str:
    """CANVASQ_FP8_GROUPED: "auto", or one of GROUPED_IMPLS; ValueError naming the setting. "auto" is
    ours ("triton") on a device with a tuned file for `experts` experts (`fp8_grouped_tiles.tuned_file`:
    tuned there, it beat torch's at 1,024 and 4,096 tokens on an H100), else torch's."""
    value = (value or "auto").strip().lower()
    if value == "auto":
        return "triton" if _tuned_here(torch.device(device), experts) else "torch"
    if value not in GROUPED_IMPLS:
        raise ValueError(f"CANVASQ_FP8_GROUPED={value!r}: expected auto, {' or '.join(GROUPED_IMPLS)}")
    return value


def _tuned_here(device: torch.device, experts: int) -> bool:
    if not fp8_supported(device):
        return False
    from canvasq.kernels.fp8_grouped_tiles import tuned_file
    from canvasq.kernels.moe.config import device_name

    return tuned_file(experts, device_name(device)).is_file()


def parse_parts(value: str | None, device: torch.device | str) -> tuple[str, ...]:
    """CANVASQ_FP8: "auto" (every part where `fp8_supported`, none elsewhere), "off", or a comma list
    of PARTS. Raises ValueError naming the setting on anything else."""
    value = (value or "auto").strip().lower()
    if value == "auto":
        return PARTS if fp8_supported(device) else ()
    if value in ("off", "none", ""):
        return ()
    parts = tuple(p.strip() for p in value.split(",") if p.strip())
    bad = [p for p in parts if p not in PARTS]
    if bad:
        raise ValueError(
            f"CANVASQ_FP8={value!r}: unknown part(s) {', '.join(bad)}; expected auto, off or a list of "
            f"{', '.join(PARTS)}"
        )
    if torch.device(device).type == "cuda" and not fp8_supported(device):  # the CPU keeps the twin for tests
        raise ValueError(
            f"CANVASQ_FP8={value!r}: this GPU has no row-scaled FP8 grouped GEMM in torch "
            "(Hopper only); use auto or off"
        )
    return parts


def install_fp8(rt, parts: tuple[str, ...], min_rows: int, grouped: str | None = None) -> int:
    """Give runtime `rt` FP8 copies of `parts` for forwards of >= `min_rows` rows; returns the bytes
    added. Tensors shared by encoder and decoder layers (HF ties them) are quantised once; the experts
    come from the BF16 weights or, where those were freed, from the W4 pack, and take their grouped
    GEMM from `grouped` (default: CANVASQ_FP8_GROUPED)."""
    setting = os.environ.get("CANVASQ_FP8_GROUPED") if grouped is None else grouped
    impl = parse_grouped(setting, rt.device, _num_experts(rt))
    bad = [p for p in parts if p not in PARTS]
    if bad:
        raise ValueError(f"unknown FP8 part(s) {bad}; known: {', '.join(PARTS)}")
    done: dict[int, FP8Linear | FP8Experts | W4A8Experts] = {}
    added = 0

    def once(key: int, make):
        nonlocal added
        if key not in done:
            done[key] = make()
            added += done[key].nbytes()
        return done[key]

    for lw in rt.enc_layers + rt.dec_layers:
        lw.fp8 = {}
        if "dense" in parts:
            for name in DENSE:
                w = getattr(lw, name)
                lw.fp8[name] = once(w.data_ptr(), lambda w=w: FP8Linear.from_weight(w))
        if "experts" in parts:
            if impl == "w4a8" and lw.experts_packed is None:
                raise ValueError("CANVASQ_FP8_GROUPED=w4a8 reads the W4 pack: load the experts as w4")
            if lw.gate_up is not None and impl != "w4a8":
                lw.fp8["experts"] = once(
                    lw.gate_up.data_ptr(), lambda lw=lw: FP8Experts.from_weights(lw.gate_up, lw.down)
                )
            elif lw.experts_packed is not None:
                lw.fp8["experts"] = once(
                    id(lw.experts_packed), lambda lw=lw: _from_pack(lw.experts_packed, impl)
                )
    for ex in done.values():
        if isinstance(ex, FP8Experts):
            ex.grouped = impl
    rt.lm_head_fp8 = FP8Linear.from_weight(rt.lm_head) if "head" in parts else None
    if rt.lm_head_fp8 is not None:
        added += rt.lm_head_fp8.nbytes()
    rt.fp8_parts, rt.fp8_min_rows = tuple(parts), int(min_rows)
    if rt.device.type == "cuda":
        torch.cuda.empty_cache()
    return added


def _num_experts(rt) -> int:
    for lw in rt.dec_layers:
        if lw.experts_packed is not None:
            return lw.experts_packed.num_experts
        if lw.gate_up is not None:
            return lw.gate_up.shape[0]
    return 0


def _from_pack(packed, impl: str) -> FP8Experts | W4A8Experts:
    return W4A8Experts.from_w4(packed) if impl == "w4a8" else FP8Experts.from_w4(packed)
