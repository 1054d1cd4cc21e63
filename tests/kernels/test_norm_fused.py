"""Fused q/k norm + RoPE and residual-update norms against their torch twins (HF's op order)."""

import pytest
import torch
from kernel_testutil import DEVICE, DTYPES, poison, rel_err

from canvasq.kernels.norm_residual import (
    add_rms_norm,
    add_rms_norm_launch,
    add_rms_norm_reference,
    pre_ffn_norms,
    pre_ffn_norms_reference,
)
from canvasq.kernels.norm_rope import (
    Scatter,
    qkv_norm_rope,
    rms_norm_rope,
    rms_norm_rope_launch,
    rms_norm_rope_reference,
)

TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def _rope_tables(n, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    pos = torch.randint(0, 5000, (n,), generator=g).float()
    inv = 1.0 / 10000 ** (torch.arange(0, d, 2).float() / d)
    inv[d // 8 :] = 0.0  # partial rotary (the full layers' proportional RoPE): cos 1, sin 0 there
    emb = torch.cat([pos[:, None] * inv, pos[:, None] * inv], dim=-1)
    return emb.cos().to(DEVICE, dtype), emb.sin().to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,heads,d", [(1, 1, 64), (7, 3, 128), (33, 8, 256)])
@pytest.mark.parametrize("weight,rope", [(True, True), (False, False), (True, False)])
def test_rms_norm_rope_parity(n, heads, d, dtype, weight, rope):
    # a column slice of a wider projection output, as the fused QKV hands it over
    wide = (torch.randn(n, (heads + 2) * d, device=DEVICE) * 3).to(dtype)
    x = wide[:, d : (heads + 1) * d].view(n, heads, d)
    assert n == 1 or not x.is_contiguous()
    w = (torch.randn(d, device=DEVICE) * 0.2 + 1).to(dtype) if weight else None
    cos, sin = _rope_tables(n, d, dtype) if rope else (None, None)
    y = rms_norm_rope_launch(x, w, cos, sin, 1e-6)
    assert y.shape == (n, heads, d) and y.is_contiguous() and torch.isfinite(y).all()
    assert rel_err(y, rms_norm_rope_reference(x, w, cos, sin)) < TOL[dtype]
    assert torch.equal(y, rms_norm_rope(x, w, cos, sin, impl="triton")), "deterministic"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rope", [True, False])
def test_rms_norm_rope_scatter_writes_rows_where_told(dtype, rope):
    """Scatter into an arena-like [slots, h, capacity, d] target: every (a[n], h, b[n]) entry holds the
    row's values (bit-equal to the plain launch), every other entry is untouched; the twin agrees."""
    n, heads, d, slots, cap = 6, 3, 64, 3, 9
    x = (torch.randn(n, heads, d, device=DEVICE) * 2).to(dtype)
    w = (torch.randn(d, device=DEVICE) * 0.2 + 1).to(dtype)
    cos, sin = _rope_tables(n, d, dtype) if rope else (None, None)
    a = torch.tensor([2, 0, 2, 1, 0, 2], device=DEVICE)
    b = torch.tensor([0, 5, 8, 3, 4, 1], device=DEVICE)
    fill = torch.full((slots, heads, cap, d), 7.0, device=DEVICE).to(dtype)
    plain = rms_norm_rope_launch(x, w, cos, sin, 1e-6)
    got = rms_norm_rope_launch(x, w, cos, sin, 1e-6, out=Scatter(fill.clone(), a, b))
    want = fill.clone()
    want[a, :, b] = plain
    assert torch.equal(got, want)
    twin = rms_norm_rope_reference(x, w, cos, sin, out=Scatter(fill.clone(), a, b))
    assert rel_err(twin, want) < TOL[dtype]
    with pytest.raises(ValueError, match="does not take"):
        rms_norm_rope_launch(x, w, cos, sin, 1e-6, out=Scatter(fill[:, :2], a, b))


def test_rms_norm_rope_twin_is_the_runtime_formula():
    from canvasq.kernels.norm_rope import rope_reference
    from canvasq.kernels.rmsnorm import rms_norm_reference

    x = torch.randn(5, 2, 64)
    w = torch.randn(64) * 0.1 + 1
    cos, sin = _rope_tables(5, 64, torch.float32)
    want = rope_reference(rms_norm_reference(x, w, 1e-6), cos.cpu(), sin.cpu())
    assert torch.equal(rms_norm_rope(x, w, cos.cpu(), sin.cpu(), impl="torch"), want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,D", [(1, 256), (9, 300), (40, 2816)])
@pytest.mark.parametrize(
    "with_x2,with_scale,pre",
    [(False, False, False), (True, True, False), (False, True, False), (True, True, True)],
)
def test_add_rms_norm_parity(rows, D, dtype, with_x2, with_scale, pre):
    x = (torch.randn(rows, D, device=DEVICE) * 2).to(dtype)
    res = torch.randn(rows, D, device=DEVICE).to(dtype)
    x2 = (torch.randn(rows, D, device=DEVICE) * 5).to(dtype) if with_x2 else None
    w = (torch.randn(D, device=DEVICE) * 0.2 + 1).to(dtype)
    scale = torch.tensor([0.7], device=DEVICE, dtype=dtype) if with_scale else None
    # pre: x2's own norm weight is small, so after the branch norms x dominates the sum (x2 does without)
    wpre = tuple((torch.randn(D, device=DEVICE) * 0.02 + s).to(dtype) for s in (1.0, 0.1)) if pre else None
    y = add_rms_norm_launch(x, w, res, x2, scale, 1e-6, pre=wpre)
    assert y.shape == res.shape and y.dtype == dtype and torch.isfinite(y).all()
    want = add_rms_norm_reference(x, w, res, x2, scale, pre=wpre)
    assert rel_err(y, want) < TOL[dtype]
    assert not torch.equal(y, poison(y.shape, dtype))
    if pre:  # the branch norms really apply
        assert rel_err(want, add_rms_norm_reference(x, w, res, x2, scale)) > 0.1


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,D", [(1, 256), (9, 300), (33, 2816)])
def test_pre_ffn_norms_parity(rows, D, dtype):
    x = (torch.randn(rows, D, device=DEVICE) * 3 + 0.5).to(dtype)
    wa, post, wb = ((torch.randn(D, device=DEVICE) * 0.2 + s).to(dtype) for s in (1.0, 2.0, 0.5))
    got = pre_ffn_norms(x, wa, post, D**-0.5, wb, 1e-6, impl="triton")
    want = pre_ffn_norms_reference(x, wa, post, D**-0.5, wb, 1e-6)
    assert torch.equal(
        torch.stack(pre_ffn_norms(x, wa, post, D**-0.5, wb, 1e-6, impl="torch")), torch.stack(want)
    )
    for g, w in zip(got, want):
        assert g.shape == x.shape and g.dtype == dtype
        assert rel_err(g, w) < TOL[dtype]
    # three different outputs (a kernel writing one of them thrice would pass a shape check)
    assert rel_err(got[0], want[1]) > 0.1 and rel_err(got[2], want[0]) > 0.1


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,D", [(37, 256), (5, 300)])
def test_norms_quantise_their_rows_for_fp8_gemms(rows, D, dtype):
    """`rms_norm_quant` and `pre_ffn_norms(quant_a=True)` write, byte for byte, what the row quantiser
    (`quantize_rows_triton`) writes from the model-dtype rows they replace, and the pre-FFN norms' other
    outputs unchanged (on the GPU the bf16 case again in tests/model/test_fp8.py at the real width)."""
    from canvasq.kernels.fp8_quant import quantize_rows_triton
    from canvasq.kernels.rmsnorm import rms_norm, rms_norm_quant

    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, D, generator=g) * 3).to(DEVICE, dtype)
    w, post, wb = ((torch.randn(D, generator=g) * 0.2 + 1).to(DEVICE, dtype) for _ in range(3))
    a0, r0, b0 = pre_ffn_norms(x, w, post, 0.3, wb, impl="triton")
    (qa, sa), r, b = pre_ffn_norms(x, w, post, 0.3, wb, impl="triton", quant_a=True)
    assert torch.equal(r, r0) and torch.equal(b, b0)
    for (q, s), y in ((rms_norm_quant(x, w), rms_norm(x, w, impl="triton")), ((qa, sa), a0)):
        want_q, want_s = quantize_rows_triton(y)
        assert torch.equal(s, want_s) and torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
        assert q.float().abs().amax() > 400  # each row's largest value at e4m3's top


def test_add_rms_norm_rejects_unknown_impl():
    x = torch.randn(2, 8)
    with pytest.raises(ValueError):
        add_rms_norm(x, torch.ones(8), x, impl="nope")
    with pytest.raises(ValueError):
        rms_norm_rope(x.view(2, 1, 8), None, impl="nope")


def test_odd_head_dim_falls_back_to_the_twin():
    x = torch.randn(3, 2, 48, device=DEVICE)  # 48 is not a power of two: the kernel cannot take it
    cos, sin = _rope_tables(3, 48, torch.float32)
    w = torch.ones(48, device=DEVICE)
    assert torch.equal(rms_norm_rope(x, w, cos, sin, impl="triton"), rms_norm_rope_reference(x, w, cos, sin))


def test_norm_kernels_compile_without_half_precision_fma():
    """Compiled for the H200 (sm_90, offline), the fused norms (and gelu_mul) must not contract a rounded product and
    a sum into `fma.rn.bf16`: with contraction on they did, and moved the trained testbed's bf16
    logits by 6 % against HF on the GPU while the interpreter (no contraction) agreed."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "kernels" / "compile_check.py"
    out = subprocess.run(
        [
            sys.executable,
            str(script),
            "--only",
            "rms_norm_rope,qkv_norm_rope,add_rms_norm,pre_ffn_norms,gelu_mul",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    # rope and the q/k/v launch at two head dims, add (with and without the experts' combine),
    # pre-FFN (with and without its first output quantised), gelu_mul
    assert summary["ok"] and summary["kernels"] == 9
    assert out.stdout.count("'half_fma': 0") == 9


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "n,hq,hk,d,with_q", [(5, 4, 2, 64, True), (33, 16, 8, 256, True), (9, 4, 1, 128, False)]
)
def test_qkv_norm_rope_is_the_three_separate_norms(dtype, n, hq, hk, d, with_q):
    """One launch for a layer's q/k/v head norms writes exactly what the three `rms_norm_rope` calls
    write (q and k from column views of one fused projection, all scattered), and nothing else; the
    twin path is the three twin calls. with_q=False: the encoder's K/V-only last layer."""
    g = torch.Generator().manual_seed(n)
    qkv = torch.randn(n, (hq + 2 * hk) * d, generator=g).to(DEVICE, dtype)
    q, k, v = (t.view(n, -1, d) for t in qkv.split([hq * d, hk * d, hk * d], dim=1))
    wq, wk = (torch.rand(d, generator=g).to(DEVICE, dtype) + 0.5 for _ in range(2))
    cos, sin = _rope_tables(n, d, dtype)
    slots, cap = 3, n + 4
    a = torch.randint(0, slots, (n,), generator=g).to(DEVICE)
    b = torch.randperm(cap, generator=g)[:n].to(DEVICE)  # distinct entries
    qa = torch.zeros(n, dtype=torch.long, device=DEVICE)
    qb = torch.arange(n, device=DEVICE)

    def targets():
        fill = lambda *shape: torch.full(shape, 7.0, dtype=dtype, device=DEVICE)
        return (
            Scatter(fill(1, hq, n, d), qa, qb),
            Scatter(fill(slots, hk, cap, d), a, b),
            Scatter(fill(slots, hk, cap, d), a, b),
        )

    want = targets()
    if with_q:
        rms_norm_rope(q, wq, cos, sin, out=want[0])
    rms_norm_rope(k, wk, cos, sin, out=want[1])
    rms_norm_rope(v, None, None, None, out=want[2])
    for impl in ("auto", "torch"):
        got = targets()
        qkv_norm_rope(q if with_q else None, k, v, wq, wk, cos, sin, 1e-6, *got, impl=impl)
        for w_, g_ in zip(want, got):
            if impl == "auto":
                assert torch.equal(g_.dst, w_.dst)
            else:
                assert rel_err(g_.dst, w_.dst) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,D,K,renorm", [(1, 256, 2, True), (7, 300, 8, True), (5, 2816, 8, False)])
def test_add_rms_norm_combines_expert_rows(T, D, K, renorm, dtype):
    """The end-of-layer norm fed the experts' uncombined rows (`ExpertRows`) writes exactly what it
    writes when fed their combine (`combine_rows`, the separate launch it replaces); the torch twin
    combines in torch first."""
    from canvasq.kernels.moe.launch import ExpertRows, combine_rows

    g = torch.Generator().manual_seed(T)
    E = 16
    m, res = (torch.randn(T, D, generator=g).to(DEVICE, dtype) for _ in range(2))
    y_tk = (torch.randn(T * K, D, generator=g) * 3).to(DEVICE, dtype)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(DEVICE)
    p = torch.rand(T, K, generator=g).to(DEVICE) + 0.1
    es = (torch.rand(E, generator=g) + 0.5).to(DEVICE, dtype) if renorm else None
    rows = ExpertRows(y_tk, p if renorm else p / p.sum(1, keepdim=True), ids, es)
    w, w1, w2 = ((torch.randn(D, generator=g) * 0.1 + s).to(DEVICE, dtype) for s in (1.0, 1.0, 0.5))
    scale = torch.tensor([0.7], device=DEVICE, dtype=dtype)
    e = combine_rows(rows)
    assert rel_err(e, rows.combined()) < TOL[dtype]
    fused = add_rms_norm(m, w, res, rows, scale, pre=(w1, w2), impl="triton")
    assert torch.equal(fused, add_rms_norm(m, w, res, e, scale, pre=(w1, w2), impl="triton"))
    twin = add_rms_norm(m, w, res, rows, scale, pre=(w1, w2), impl="torch")
    assert rel_err(fused, twin) < TOL[dtype]
    assert rel_err(fused, add_rms_norm(m, w, res, None, scale, impl="torch")) > 0.01  # the rows count
    # the same rows left in another order (the FP8 experts' expert order) and read through a row map
    perm = torch.randperm(T * K, generator=g).to(DEVICE)
    moved = y_tk.new_empty(y_tk.shape)
    moved[perm] = y_tk
    mapped = ExpertRows(moved, rows.weights, ids, es, row_map=perm)
    assert torch.equal(add_rms_norm(m, w, res, mapped, scale, pre=(w1, w2), impl="triton"), fused)
    assert torch.equal(add_rms_norm(m, w, res, mapped, scale, pre=(w1, w2), impl="torch"), twin)
