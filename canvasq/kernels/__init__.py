"""canvasq kernels: Triton kernels, each with a pure-torch twin. Nothing here knows about decoders.

- `w4_moe(x, topk_ids, topk_weights, packed)`: grouped W4A16 routed experts (`moe/`), with
  `pack_w4`, `unpack_w4`, `pack_model_experts`, `save_packed`, `load_packed`.
- `rms_norm(x, weight, eps)`: DiffusionGemma RMSNorm (`weight=None` for the with_scale=False norm).
- `rms_norm_rope(x, weight, cos, sin)` / `add_rms_norm(x, weight, residual, x2, scale, pre)` /
  `pre_ffn_norms(x, wa, post, scalar, wb)`: the q/k norm + RoPE, the residual-update norms and the
  three pre-FFN norms of a layer, one launch each (`norm_rope.py`, `norm_residual.py`).
- `gelu_mul(gu)`: the dense MLP's gelu_tanh(gate) * up over the fused gate/up output (`gelu_mul.py`).
- `router_topk(logits, k)`: the MoE router's fp32 softmax + top-k in one launch (`router.py`).
- `softcap_logits(x, cap)`: the LM head's fp32 cast + final soft cap in one pass (`softcap.py`).
- `softmax_argmax(logits, temperature)`: (max-prob confidence, argmax, entropy) per row;
  `softmax_sample` adds a draw (Gumbel-max, or inverse CDF: `softmax_invcdf.py`) and a renoise
  token from per-group Philox seeds.
- `fuse_qkv_weights` / `qkv_proj`: one GEMM for q, k, v after the LoRA merge.

Every public function takes `impl="auto" | "triton" | "torch"`; auto picks Triton on CUDA, Triton
through the interpreter on CPU when TRITON_INTERPRET=1 was set before import and still is, and the
torch twin otherwise (the CPU testbed). See `_dispatch.py`.
"""

from .attention import attend, attend_reference
from .gelu_mul import gelu_mul, gelu_mul_reference
from .moe import (
    MoeLaunchConfig,
    W4Config,
    W4Experts,
    load_packed,
    pack_model_experts,
    pack_w4,
    save_packed,
    unpack_w4,
    w4_moe,
    w4_moe_reference,
)
from .norm_residual import add_rms_norm, add_rms_norm_reference, pre_ffn_norms, pre_ffn_norms_reference
from .norm_rope import rms_norm_rope, rms_norm_rope_reference
from .qkv import FusedQKV, fuse_attention_module, fuse_qkv_weights, qkv_proj, qkv_proj_reference
from .rmsnorm import rms_norm, rms_norm_reference
from .router import router_topk, router_topk_reference
from .softcap import softcap_logits, softcap_reference
from .softmax_argmax import softmax_argmax, softmax_argmax_reference, softmax_sample

__all__ = [
    "FusedQKV",
    "MoeLaunchConfig",
    "W4Config",
    "W4Experts",
    "add_rms_norm",
    "add_rms_norm_reference",
    "attend",
    "attend_reference",
    "fuse_attention_module",
    "fuse_qkv_weights",
    "gelu_mul",
    "gelu_mul_reference",
    "load_packed",
    "pack_model_experts",
    "pack_w4",
    "pre_ffn_norms",
    "pre_ffn_norms_reference",
    "qkv_proj",
    "qkv_proj_reference",
    "rms_norm",
    "rms_norm_reference",
    "rms_norm_rope",
    "rms_norm_rope_reference",
    "router_topk",
    "router_topk_reference",
    "save_packed",
    "softcap_logits",
    "softcap_reference",
    "softmax_argmax",
    "softmax_argmax_reference",
    "softmax_sample",
    "unpack_w4",
    "w4_moe",
    "w4_moe_reference",
]
