"""The runtime with its fused norm kernels (Triton; interpreted on CPU) against HF's forward, fp32."""

import functools

import pytest
import torch
from kernel_testutil import rel_err

from canvasq.kernels.router import router_topk
from canvasq.model.loading import cache_kwargs, load_bundle
from canvasq.model.runtime import Runtime, Window
from tests.harness.hf import hf_cache

# CPU tensors through the interpreted kernels: where CUDA is present conftest leaves the kernels compiled,
# and CPU tensors cannot reach them. The
# same paths on CUDA: tests/model/test_model_gpu.py (testbed bf16 with kernels vs HF, W4 vs dequantised).
pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="interpreter test; the CUDA twin is tests/model/test_model_gpu.py"
)


# Two of the four (dtype, attention) cases run by default: fp16 through the attention kernel (the
# rounding case, and the kernel inside the runtime) and fp32 through SDPA (the norm kernels' fp32
# exactness); the other two add ~25 s of interpreter each and are `large` (`-m large` on a CPU: this
# file is skipped where CUDA is, so the GPU checks do not run it). The attention kernel's own fp32 and
# fp16 parity with SDPA is tests/kernels/test_attention.py.
_SLOW = pytest.mark.large


@torch.no_grad()
@pytest.mark.parametrize(
    "dtype,tol,attention",
    [
        (torch.float16, 2e-2, "kernel"),
        (torch.float32, 1e-4, "sdpa"),
        pytest.param(torch.float32, 1e-4, "kernel", marks=_SLOW),
        pytest.param(torch.float16, 2e-2, "sdpa", marks=_SLOW),
    ],
)
def test_runtime_with_fused_kernels_matches_hf(dtype, tol, attention, monkeypatch):
    """fp16 stands in for bf16 (the interpreter cannot load bf16): the fused kernels must round where
    HF's modules round, else the trained model's logits move by ~8 % (the bf16 bound is 2e-2).
    attention: the testbed's windows (40 prompt rows, 32 canvas rows) through `kernels.attention`, or,
    with `Runtime.kernel_rows` at 0, through SDPA."""
    import canvasq.kernels.attention as attention_module

    calls = []  # launches of the attention kernel
    real_launch = attention_module.attend_launch
    monkeypatch.setattr(
        attention_module, "attend_launch", lambda *a, **k: calls.append(1) or real_launch(*a, **k)
    )
    m = load_bundle(device="cpu", dtype=dtype).hf_model  # the trained testbed
    g = torch.Generator().manual_seed(4)
    b, p, c = 3, 40, m.config.canvas_length  # a case where unrounded epilogues move logits by 8 %
    prompts = torch.randint(5, 700, (b, p), generator=g)
    canvas = torch.randint(5, 700, (b, c), generator=g)
    cache = hf_cache(m, prompts)
    pos = torch.arange(p, p + c)[None].expand(b, c)
    ref = m(decoder_input_ids=canvas, **cache_kwargs(m, cache), decoder_position_ids=pos).logits
    rt = Runtime.from_hf(m, kernels=True)  # q/k norm + RoPE and residual norms through the Triton kernels
    if attention == "sdpa":
        rt.kernel_rows = 0  # every window through SDPA
    if dtype == torch.float16:
        # 16-bit router logits tie; the router kernel takes the lower expert id (as CUDA's topk does)
        # where CPU torch.topk may take another, which swaps an expert (its parity: test_router.py)
        rt._router = functools.partial(router_topk, impl="torch")
    arena = rt.new_arena(b, 128)
    rt.encode_many(arena, [(i, prompts[i], torch.arange(p)) for i in range(b)])
    out = rt.decode(arena, [Window.canvas(i, canvas[i], p) for i in range(b)]).logits
    assert rel_err(out, ref.reshape(b * c, -1)) <= tol
    assert (len(calls) > 0) == (attention == "kernel")  # the path asked for is the one taken


@torch.no_grad()
def test_runtime_w4_kernels_match_w4_twins(monkeypatch):
    """experts="w4" with every kernel on (the W4 MoE through the interpreter, the router epilogue
    inside its combine) against the same runtime on its torch twins: the runtime hands the kernels
    raw top-k probabilities and the expert scales, and the twins renormalise them in torch."""
    m = load_bundle(device="cpu", dtype=torch.float32).hf_model
    g = torch.Generator().manual_seed(5)
    p, c = 24, m.config.canvas_length
    prompt, canvas = torch.randint(5, 700, (p,), generator=g), torch.randint(5, 700, (c,), generator=g)
    outs = []
    for kernels in (False, True):
        monkeypatch.setenv("TRITON_INTERPRET", "1" if kernels else "0")  # w4_moe's impl="auto"
        rt = Runtime.from_hf(m, experts="w4", kernels=kernels)
        arena = rt.new_arena(1, 96)
        rt.encode(arena, 0, prompt, torch.arange(p))
        outs.append(rt.decode(arena, [Window.canvas(0, canvas, p)]).logits)
    assert rel_err(outs[1], outs[0]) <= 1e-4
    assert not torch.equal(outs[1], outs[0])  # the kernels ran (fp32 sums in another order)
