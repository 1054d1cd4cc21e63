"""The DiffusionGemma forward we own: weights taken from an HF model, a KV arena, window forwards.

Flow: Job (core, CPU) → DecodeBatch (worker) → windows (model, GPU: `Window`s, one per sequence, one forward). In this module the
windows of one pass are a list of `Window`s, one per sequence in the batch, each with its own
arena slot; all windows run in **one** forward (rows of every window are concatenated into one
[N, H] matrix for every dense part; attention is batched per window over its own slot).

    rt = Runtime.from_hf(hf_model)                       # shares HF's tensors, no copies
    arena = rt.new_arena(slots=4, capacity=2048)
    rt.encode(arena, slot, prompt_ids, positions)        # causal pass, appends K/V + positions
    out = rt.decode(arena, [Window.canvas(slot, canvas_ids, start=len(prompt)), ...])
    out.logits                                           # [N, V] fp32, softcapped, rows in window order
    arena.promote(slot, out.captured[i])                 # captured rows (Window.capture) join the context

Visibility, for a query row with absolute position p in a window with `canvas_start`/`canvas_end`
per row (all keys are addressed by *stored position*, never by entry index):

    full layers:     key position q visible  iff  q < canvas_end[row]
    sliding layers:  ... and q >= canvas_start[row] - (W - 1)
    encoder rows:    canvas_end = p + 1, canvas_start = p   (causal; sliding q > p - W, as HF)

The sliding rule for decoder rows reproduces what HF's decoder sees: its DynamicSlidingWindowLayer
keeps the last W - 1 tokens cached before the canvas, and the canvas attends to all of them.
Keys are the slot's committed arena entries plus the window's own rows (written to the slot's scratch
region for the forward, then left there uncommitted). Several canvases of one sequence in one window
are block-causal through `canvas_end` (D2F pipe); Funnel's scattered rows use the same rule.

Self-conditioning per window: `None` (zero signal, HF's first step), full logits [R, V] (HF's
softmax over the vocab times the embedding table), or top-k `(ids [R, k], logits [R, k])`:
softmax renormalised over the k entries, only those k embedding rows gathered ("top-k
self-conditioning projection"). `Window.self_cond_rows` [R] bool limits SC to some rows.

Numerics follow HF op for op (RMSNorm in fp32 then cast, RoPE cos/sin in fp32 then cast, router
softmax fp32, expert outputs weighted and summed in fp32, final softcap 30 in fp32), so fp32 CPU
logits match HF to ~1e-6 and bf16 GPU logits to bf16 noise.

Implementations: `experts="bf16"` runs the model-dtype experts as two grouped GEMMs on CUDA (the
kernel HF's default `grouped_mm` uses; no host sync) and as a sorted-by-expert loop elsewhere
(`"grouped"` / `"reference"` force one); `experts="w4"` packs the experts once (shared by encoder and
decoder; on CUDA in the Gluon kernels' tiled order) and calls `canvasq.kernels.moe.w4_moe`.
`kernels=True` (default on CUDA) uses the Triton RMSNorm of `canvasq.kernels` and its fused epilogues
(`norm_rope`, `norm_residual`: the q/k/v head norms and q/k RoPE in one launch, residual-update norms with the layer scalar), which round
where HF's modules round, and the router's softmax + top-k in one launch (`router_topk`); q/k/v and the
dense gate/up always run as one GEMM each over weights concatenated once at construction (an extra
copy of those weights, ~2.8 GB bf16 at the real shape). Each expert combine is a fixed-order fp32
sum: reruns are bit-identical.

A forward is `_prepare` (host work: scratch placement, index tensors, per-row bounds) then `_run`
(device work only: positions into the arena, masks, RoPE, layers, LM head). `graph.DecodeGraph` captures
`_run` as a CUDA graph for a bucket of rows per window and of context length, and replays it with
new ids / positions / bounds / SC inputs while the arena grows: one launch per decoder step.
Windows are padded to the bucket with `graph.pad_window` (padding rows are invisible to real rows).
Expert twins live in `experts.py` (`moe_reference`, `moe_grouped`).
Prefix attention: an eager forward whose mask is all-visible for every real row (one
canvas, context before it, sliding band not clipping, equal slot lengths) runs mask-free SDPA
(`rt.prefix_attention`, default on; graphs always apply the mask).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from canvasq.kernels.attention import KERNEL_ROWS
from canvasq.kernels.gelu_mul import gelu_mul
from canvasq.kernels.moe.reference import route_weights
from canvasq.kernels.norm_residual import add_rms_norm, pre_ffn_norms
from canvasq.kernels.norm_rope import Scatter, qkv_norm_rope
from canvasq.kernels.rmsnorm import rms_norm as rms_norm_any
from canvasq.kernels.rmsnorm import rms_norm_quant
from canvasq.kernels.router import router_topk
from canvasq.kernels.softcap import softcap_logits
from canvasq.model.arena import KVArena
from canvasq.model.embedding import embed, rope
from canvasq.model.experts import grouped_mm_available, moe_grouped, moe_reference
from canvasq.model.fp8 import fp8_gated_linear, fp8_linear, fp8_moe, scaled_rows
from canvasq.model.prepared import Prepared, prepare
from canvasq.model.weights import (
    LayerWeights,
    checked_text_config,
    fuse_projections,
    layer_weights,
    pack_experts_w4,
    rope_tables,
)
from canvasq.model.windows import DecodeOutput, SelfCond, Window, encoder_windows  # noqa: F401 (re-exported)

if TYPE_CHECKING:
    from canvasq.model.graph import GraphRunner

# Legend: N rows in the forward (all windows), R rows of one window, B windows, H hidden, V vocab,
# h heads / kv heads of a layer, d head dim, L arena entries visible (prefix + window), E experts,
# K experts per token, I expert width.

# "bf16": the model-dtype experts, grouped GEMMs on CUDA and the per-expert loop elsewhere;
# "reference" / "grouped": force one of those; "w4": canvasq.kernels' packed W4A16 MoE.


class Runtime:
    """DiffusionGemma encoder + decoder over a `KVArena`; see the module docstring."""

    def __init__(
        self,
        enc_layers: list[LayerWeights],
        dec_layers: list[LayerWeights],
        *,
        embed: torch.Tensor,
        embed_scale: torch.Tensor,
        lm_head: torch.Tensor,
        final_norm: torch.Tensor,
        top_k: int,
        sc: dict[str, torch.Tensor],
        inv_freq: dict[bool, torch.Tensor],
        rope_scaling: dict[bool, float],
        sliding_window: int,
        eps: float,
        softcap: float | None,
        experts: str = "bf16",
        kernels: bool | None = None,
    ):
        self.enc_layers, self.dec_layers = enc_layers, dec_layers
        self.embed, self.embed_scale, self.lm_head = embed, embed_scale, lm_head
        self.final_norm, self.top_k = final_norm, top_k
        self.sc = sc
        self.inv_freq, self.rope_scaling = inv_freq, rope_scaling
        self.sliding_window, self.eps, self.softcap = sliding_window, eps, softcap
        self.experts = experts
        self.dtype, self.device = embed.dtype, embed.device
        self.vocab_size, self.hidden_size = embed.shape
        self._bind_ops(experts, self.device.type == "cuda" if kernels is None else kernels)
        fuse_projections(enc_layers + dec_layers)
        # HF ties the encoder's and decoder's weights but not their `layer_scalar` buffers: where they
        # are equal, encoder rows riding in a decoder forward need no per-row scalar
        self.tied_scalars = all(
            torch.equal(e.layer_scalar, d.layer_scalar) for e, d in zip(enc_layers, dec_layers)
        )
        # encoder rows can ride in a decoder forward (`Window.encoder_rows`) only on the same weights
        self.tied_weights = all(
            e.wqkv is d.wqkv and e.wo is d.wo and e.mlp_gate_up is d.mlp_gate_up and e.mlp_down is d.mlp_down
            for e, d in zip(enc_layers, dec_layers)
        )
        self._attention_defaults()
        self.scope: Callable[[str], contextlib.AbstractContextManager] = lambda name: contextlib.nullcontext()
        self.graph_runner: GraphRunner | None = None  # `model.graph.graph_runner(self)`: the loop's graphs
        # FP8 copies (`fp8.install_fp8`) for forwards of at least `fp8_min_rows` rows, where the forward
        # is compute-bound; smaller forwards keep the model-dtype / W4 path
        self.fp8_parts: tuple[str, ...] = ()
        self.fp8_min_rows = 0
        self.lm_head_fp8 = None
        # an eager decoder forward whose fp32 logits would exceed this defers its LM head: the decoder
        # reads logits by row group (`DecodeOutput.rows_logits`); 0: never
        self.defer_head_bytes = 4 << 30
        # SC's top-k bag: "triton" (kernels/soft_embed) on a GPU, 0.6 and 1.1 ms off a graphed forward at
        # 4 and 16 x 256 rows on an H100 with the guard unchanged (BENCHMARKS "Persistent grouped GEMM,
        # PDL, routing order and deferred heads"); "torch" (F.embedding_bag) elsewhere
        self.sc_bag = "triton" if self.device.type == "cuda" else "torch"

    def _attention_defaults(self) -> None:
        """Masked eager forwards on CUDA: SDPA picks cuDNN, which builds a plan for every new shape
        (~25 ms of host time each), so decoder steps read a context rounded up to a multiple of
        `context_step` entries (shapes repeat; 0: exact) and encoder passes, whose batch and rows vary
        pass to pass, take the mem-efficient kernel (`encoder_sdpa_backend`; see
        `kernels.attention.SDPA_BACKENDS`). Measured: BENCHMARKS.md, "Service throughput"."""
        cuda = self.device.type == "cuda"
        self.prefix_attention = True  # mask-free SDPA when the mask is all-visible (eager forwards)
        self.sdpa_backend = "auto"
        self.encoder_sdpa_backend = "efficient" if cuda else "auto"
        self.context_step = 256 if cuda else 0
        # windows of up to this many rows attend through our kernel (with `kernels`: by default every
        # window), longer ones through SDPA (0: every window)
        self.kernel_rows = KERNEL_ROWS
        self.attention_tiles = ""  # the kernel's tiles by head dim, "256:64x32x4x2/512:..."; "": its table
        # eager forwards by attention path: "maskfree" (all-visible, SDPA without a mask) or "masked"
        # (ragged contexts, a sliding band that clips, padded rows); graphed forwards always mask
        self.attention_paths = {"maskfree": 0, "masked": 0}

    def _bind_ops(self, experts: str, kernels: bool) -> None:
        """The experts' implementation (`EXPERT_IMPLS`: "bf16" is grouped GEMMs on CUDA, the loop
        elsewhere), and the Triton RMSNorm and fused norm epilogues on CUDA (one launch each instead
        of ~6-8) or HF's op order (the torch twins) elsewhere."""
        if experts == "w4":
            self._moe: Callable = self._moe_w4
        elif experts == "grouped" or (
            experts == "bf16" and self.device.type == "cuda" and grouped_mm_available()
        ):
            self._moe = self._moe_grouped
        else:
            self._moe = self._moe_reference
        self.kernels = kernels
        impl = "triton" if kernels else "torch"
        self._norm: Callable = functools.partial(rms_norm_any, impl=impl)
        self._pre_ffn: Callable = functools.partial(pre_ffn_norms, impl=impl)
        self._qkv_norms: Callable = functools.partial(qkv_norm_rope, impl=impl)  # twin for odd head dims
        self._add_norm: Callable = functools.partial(add_rms_norm, impl=impl)
        self._gelu_mul: Callable = functools.partial(gelu_mul, impl=impl)
        self._router: Callable = functools.partial(router_topk, impl=impl)
        self._softcap: Callable = functools.partial(softcap_logits, impl=impl)

    # --- construction ------------------------------------------------------------------------------
    @classmethod
    def from_hf(
        cls, hf_model, experts: str = "bf16", kernels: bool | None = None, encoder_model=None
    ) -> Runtime:
        """Take the weights of a `DiffusionGemmaForBlockDiffusion` (testbed, real, or random).

        Encoder and decoder layers are read from their own modules: HF ties their weights (same
        tensors, so nothing is held twice) but not their buffers (`layer_scalar`). `encoder_model`
        (default `hf_model`) supplies the encoder layers' attention, dense MLP, norms and router: a
        LoRA merged into `hf_model` then reaches the decoder steps only (the D2F adapter was trained
        on decoder passes; merged, it rewrites the tied encoder too). Its experts are taken from
        `hf_model`'s layers, so the expert weights and W4 packs stay one copy: only for a pair that
        differs outside the experts (the adapters' `target_modules` exclude them)."""
        tc = checked_text_config(hf_model, experts)
        enc = (encoder_model if encoder_model is not None else hf_model).model.encoder.language_model
        dec = hf_model.model.decoder
        dec_layers = [layer_weights(layer) for layer in dec.layers]
        enc_layers = [layer_weights(layer) for layer in enc.layers]
        if encoder_model is not None:
            enc_layers = [
                replace(e, gate_up=d.gate_up, down=d.down, experts_packed=d.experts_packed)
                for e, d in zip(enc_layers, dec_layers)
            ]
        if experts != "w4" and any(lw.gate_up is None for lw in enc_layers + dec_layers):
            raise ValueError(
                f"experts={experts!r} needs the BF16 experts, but this model's were packed to W4 "
                "at load and freed (CANVASQ_EXPERTS=w4); load it with CANVASQ_EXPERTS=bf16"
            )
        inv_freq, rope_scaling = rope_tables(dec.rotary_emb)
        sc_mod = dec.self_conditioning
        sc = {
            "pre_norm": sc_mod.pre_norm.weight,
            "gate": sc_mod.gate_proj.weight,
            "up": sc_mod.up_proj.weight,
            "down": sc_mod.down_proj.weight,
        }
        rt = cls(
            enc_layers,
            dec_layers,
            embed=dec.embed_tokens.weight,
            embed_scale=dec.embed_tokens.embed_scale,
            lm_head=hf_model.lm_head.weight,
            final_norm=dec.norm.weight,
            top_k=int(tc.top_k_experts),
            sc=sc,
            inv_freq=inv_freq,
            rope_scaling=rope_scaling,
            sliding_window=int(tc.sliding_window),
            eps=float(tc.rms_norm_eps),
            softcap=hf_model.config.get_text_config().final_logit_softcapping,
            experts=experts,
            kernels=kernels,
        )
        if experts == "w4":
            pack_experts_w4(rt.enc_layers + rt.dec_layers, rt.dtype)
        return rt

    @property
    def num_layers(self) -> int:
        return len(self.dec_layers)

    @property
    def layer_shapes(self) -> list[tuple[int, int]]:
        """(kv_heads, head_dim) per layer, what `KVArena` allocates."""
        return [(lw.kv_heads, lw.head_dim) for lw in self.dec_layers]

    def new_arena(self, slots: int, capacity: int) -> KVArena:
        return KVArena(self.layer_shapes, slots, capacity, device=self.device, dtype=self.dtype)

    # --- public passes -----------------------------------------------------------------------------
    @torch.no_grad()
    def encode(self, arena: KVArena, slot: int, token_ids: torch.Tensor, positions: torch.Tensor) -> None:
        """Causal encoder pass over `token_ids` [R] at `positions` [R] (prompt, or a finished canvas
        being committed); appends their K/V and positions to the slot. Keys visible to a row: the
        slot's entries and the new rows with position <= its own (sliding: > its own - W)."""
        self.encode_many(arena, [(slot, token_ids, positions)])

    @torch.no_grad()
    def encode_many(self, arena: KVArena, items: list[tuple[int, torch.Tensor, torch.Tensor]]) -> None:
        """`encode` for several slots in one forward."""
        windows = encoder_windows(items)
        self._forward(arena, windows, encoder=True)
        for w in windows:
            arena.commit(w.slot, w.rows)

    @torch.no_grad()
    def decode(
        self, arena: KVArena, windows: list[Window], prefix_attention: bool | None = None
    ) -> DecodeOutput:
        """Decoder forward over several windows (one arena slot each, read-only). Returns fp32
        softcapped logits for every row and, per window, the captured K/V of its `capture` rows.
        `prefix_attention` overrides `self.prefix_attention` for this forward. A window's leading
        `encoder_rows` are an encoder pass in the same forward (see `Window`): no logits come back for
        them, and their K/V are committed to the slot after the forward."""
        out = self._forward(arena, windows, encoder=False, prefix_attention=prefix_attention)
        assert out is not None  # a decoder forward has logits
        for w in windows:
            if w.encoder_rows:
                arena.commit(w.slot, w.encoder_rows)
        return out

    # --- the forward -------------------------------------------------------------------------------
    # Split in two so a decoder step can be replayed as a CUDA graph (`DecodeGraph`): `_prepare` does
    # every host-side and host→device step (scratch placement, masks, RoPE tables, index tensors);
    # `_run` only launches device work on tensors `_prepare` made, with no host sync.
    def _forward(
        self, arena: KVArena, windows: list[Window], encoder: bool, prefix_attention: bool | None = None
    ) -> DecodeOutput | None:
        prep = self._prepare(arena, windows, encoder)
        if prefix_attention is not None:
            prep.prefix_attention = prefix_attention
        offsets = prep.offsets if prep.enc_rows is None else prep.dec_offsets
        rows = offsets[-1]
        prep.defer_head = not encoder and 0 < self.defer_head_bytes < 4 * rows * self.vocab_size
        out, cap_k, cap_v = self._run(prep)
        if encoder:
            return None
        captured = prep.split_captured(cap_k, cap_v)
        if prep.defer_head:  # `out` is the final-normed hidden state: logits as the decoder reads them
            return self.deferred_output(out, offsets, captured, rows)
        return DecodeOutput(out, offsets, captured)

    def deferred_output(self, hidden, offsets: list[int], captured, rows: int) -> DecodeOutput:
        """A forward's output whose LM head runs when its rows are read (`DecodeOutput.head`): `hidden`
        the final-normed rows; the head FP8 or not by the whole forward's `rows`."""
        fp8 = self.lm_head_fp8 is not None and rows >= self.fp8_min_rows
        head, uncapped = (functools.partial(f, fp8=fp8) for f in (self.head_logits, self.head_uncapped))
        kw = {"hidden": hidden, "softcap": self.softcap}
        return DecodeOutput(None, offsets, captured, head=head, uncapped=uncapped, **kw)

    def _prepare(
        self,
        arena: KVArena,
        windows: list[Window],
        encoder: bool,
        lmax: int | None = None,
        capture: bool = True,
    ) -> Prepared:
        """The forward's host side (`model.prepared.prepare`): what `_run` reads."""
        return prepare(self, arena, windows, encoder, lmax, capture)

    def _run(self, prep: Prepared):
        layers = self.enc_layers if prep.encoder else self.dec_layers
        # window positions into the slots' scratch, then masks and RoPE tables from device tensors only
        prep.arena.pos[prep.row_slot, prep.row_col] = prep.pos
        maskfree = self.prefix_attention if prep.prefix_attention is None else prep.prefix_attention
        prep.ctx.build_masks(prep.arena, detect_maskfree=maskfree and not prep.static)
        if not prep.static:
            self.attention_paths["maskfree" if prep.ctx.maskfree[False] else "masked"] += 1
        prep.cos_sin = {
            sl: rope(prep.pos, inv, self.rope_scaling[sl], self.dtype) for sl, inv in self.inv_freq.items()
        }
        h = embed(self, prep)
        cap_k: list[torch.Tensor] = []
        cap_v: list[torch.Tensor] = []
        last = len(layers) - 1
        for i, lw in enumerate(layers):
            kv_only = prep.encoder and i == last  # the encoder's last layer: its K/V only
            cos, sin = prep.cos_sin[lw.sliding]
            h = self._attention(i, lw, h, cos, sin, prep, cap_k, cap_v, kv_only)
            h = h if kv_only else self._feed_forward(i, lw, h, prep)
        if prep.encoder:
            return None, cap_k, cap_v
        with self.scope("final_norm"):
            if prep.dec_rows is not None:  # encoder rows that rode along need no logits
                h = h.index_select(0, prep.dec_rows)
            h = self._norm(h, self.final_norm, self.eps)
        if prep.defer_head:
            return h, cap_k, cap_v
        fp8 = self.lm_head_fp8 is not None and h.shape[0] >= self.fp8_min_rows
        return self.head_logits(h, fp8, out=prep.logits_out), cap_k, cap_v

    def head_logits(self, h: torch.Tensor, fp8: bool, out: torch.Tensor | None = None) -> torch.Tensor:
        """Final-normed hidden rows [n, H] -> fp32 softcapped logits [n, V], like HF (the FP8 head's
        bf16 output, or the model-dtype one's, softcapped into fp32)."""
        head = self.head_uncapped(h, fp8)
        with self.scope("lm_head"):
            return self._softcap(head, self.softcap, out=out)

    def head_uncapped(self, h: torch.Tensor, fp8: bool) -> torch.Tensor:
        """Final-normed hidden rows [n, H] -> the head's output before the soft cap [n, V] (the model
        dtype, or the FP8 head's bf16)."""
        with self.scope("lm_head"):
            fp8_head = self.lm_head_fp8 if fp8 else None
            return F.linear(h, self.lm_head) if fp8_head is None else fp8_linear(h, fp8_head)

    def _attention(self, i, lw: LayerWeights, h, cos, sin, prep: Prepared, cap_k, cap_v, kv_only: bool):
        """Layer i's attention half on the residual stream h: its K/V into the arena, and (but for the
        encoder's last layer, kv_only) h + norm(o_proj(attention))."""
        eps = self.eps
        n = h.shape[0]
        with self.scope("attention"):
            nq, nk, d = lw.heads * lw.head_dim, lw.kv_heads * lw.head_dim, lw.head_dim
            w8 = self._fp8(n, lw, "wqkv") if self.kernels else None  # FP8: the norm writes its rows quantised
            if w8 is None:  # [N, nq + nk (+ nk)]; q, k, v are column views of it
                qkv = self._dense(self._norm(h, lw.ln_in, eps), lw, "wqkv")
            else:
                qkv = scaled_rows(*rms_norm_quant(h, lw.ln_in, eps), w8, h.dtype)
            k_raw = qkv[:, nq : nq + nk].view(n, lw.kv_heads, d)
            v = qkv[:, nq + nk :].view(n, lw.kv_heads, d) if lw.wv is not None else k_raw
            # k-norm + RoPE and the v-norm write straight into the rows' arena entries (no index_put),
            # q-norm + RoPE into the attention's folded layout [B, h, Rmax, d] (no permute copy): one
            # launch on CUDA. The encoder's last layer (kv_only) needs only its K/V.
            arena_k, arena_v = prep.arena.k[i], prep.arena.v[i]
            q_out = None if kv_only else prep.ctx.query_target(lw.heads, d, h.dtype)
            self._qkv_norms(
                None if kv_only else qkv[:, :nq].view(n, lw.heads, d),
                k_raw,
                v,
                lw.q_norm,
                lw.k_norm,
                cos,
                sin,
                eps,
                q_out,
                Scatter(arena_k, prep.row_slot, prep.row_col),
                Scatter(arena_v, prep.row_slot, prep.row_col),
            )
            if prep.capture is not None:
                cap_k.append(arena_k[prep.cap_slot, :, prep.cap_col])
                cap_v.append(arena_v[prep.cap_slot, :, prep.cap_col])
            if kv_only:
                return h
            assert q_out is not None  # made for every layer but kv_only
            a = prep.ctx.attend(i, prep.arena, q_out.dst, lw.sliding)  # [N, h*d]
            a = self._dense(a, lw, "wo")
            return self._add_norm(a, lw.ln_post_attn, h, None, None, eps)  # h + norm(a)

    def _feed_forward(self, i, lw: LayerWeights, h, prep: Prepared):
        """Layer i's dense MLP and routed experts on h, and the end-of-layer residual update."""
        eps = self.eps
        with self.scope("dense_mlp"):  # (with the router's and the experts' input norms: one launch)
            w8 = self._fp8(h.shape[0], lw, "mlp_gate_up") if self.kernels else None
            norms = (lw.ln_pre_ff, lw.router_scale, self.hidden_size**-0.5, lw.ln_pre_ff2, eps)
            x, r, x_e = self._pre_ffn(h, *norms, quant_a=w8 is not None)  # FP8: x comes quantised
            gu = self._dense(x, lw, "mlp_gate_up") if w8 is None else scaled_rows(x[0], x[1], w8, h.dtype)
            m = self._dense(gu, lw, "mlp_down", gated=True)
        with self.scope("experts"):  # router + routed experts
            topk_p, topk_ids = self._router(F.linear(r, lw.router_proj), self.top_k)  # fp32 softmax, top-k
            # each implementation applies the router epilogue (`route_weights`) itself: W4 in its combine
            moe = self._moe if self._fp8(h.shape[0], lw, "experts") is None else self._moe_fp8
            e = moe(x_e, topk_ids, topk_p, lw)
        # (h + norm(norm(m) + norm(e))) * scalar: the branches' post-norms and the residual update in one
        per_row = prep.enc_rows is not None and not self.tied_scalars
        scale = None if per_row else lw.layer_scalar
        out = self._add_norm(m, lw.ln_post_ff, h, e, scale, eps, pre=(lw.ln_post_ff1, lw.ln_post_ff2))
        if per_row:  # encoder rows riding in a decoder forward take the encoder layer's scalar (HF rounds
            # the residual sum, then the product: as here)
            assert prep.enc_rows is not None  # per_row says so
            scalar = torch.where(prep.enc_rows[:, None], self.enc_layers[i].layer_scalar, lw.layer_scalar)
            out = out * scalar.to(out.dtype)
        return out

    def _fp8(self, rows: int, lw: LayerWeights, name: str):
        """The FP8 copy of `name` when this forward is large enough to use it, else None."""
        return lw.fp8.get(name) if rows >= self.fp8_min_rows else None

    def _dense(self, x, lw: LayerWeights, name: str, gated: bool = False):
        """x @ lw.<name>.T, FP8 from `fp8_min_rows` rows. `gated`: x is the dense MLP's gate/up output,
        gelu_tanh(gate) * up taken first (FP8: quantised as it is made, `fp8_gated_linear`)."""
        q = self._fp8(x.shape[0], lw, name)
        if gated and q is not None:
            return fp8_gated_linear(x, q, self._gelu_mul)
        x = self._gelu_mul(x) if gated else x
        return F.linear(x, getattr(lw, name)) if q is None else fp8_linear(x, q)

    # the four take the router's raw top-k probabilities
    def _moe_fp8(self, x, topk_ids, topk_p, lw: LayerWeights):
        # with the fused norms, the combine happens in the end-of-layer norm (`ExpertRows`), as for W4
        ex = lw.fp8["experts"]
        return fp8_moe(x, topk_ids, topk_p, ex, expert_scale=lw.per_expert_scale, defer_combine=self.kernels)

    def _moe_reference(self, x, topk_ids, topk_p, lw: LayerWeights):
        assert lw.gate_up is not None and lw.down is not None  # the BF16 experts (not freed for W4)
        return moe_reference(
            x, topk_ids, route_weights(topk_p, topk_ids, lw.per_expert_scale), lw.gate_up, lw.down
        )

    def _moe_grouped(self, x, topk_ids, topk_p, lw: LayerWeights):
        assert lw.gate_up is not None and lw.down is not None  # the BF16 experts (not freed for W4)
        return moe_grouped(
            x, topk_ids, route_weights(topk_p, topk_ids, lw.per_expert_scale), lw.gate_up, lw.down
        )

    def _moe_w4(self, x, topk_ids, topk_p, lw: LayerWeights):
        from canvasq.kernels.moe import w4_moe

        # with the fused norms, the combine happens in the end-of-layer norm (`ExpertRows`)
        assert lw.experts_packed is not None  # packed by pack_experts_w4 or at load
        ex = lw.experts_packed
        return w4_moe(x, topk_ids, topk_p, ex, expert_scale=lw.per_expert_scale, defer_combine=self.kernels)
