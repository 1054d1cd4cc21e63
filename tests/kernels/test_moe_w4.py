"""W4A16 MoE: packing error, layout, routing metadata, kernel vs dequantised twin, determinism, HF patching."""

from dataclasses import replace

import pytest
import torch
from kernel_testutil import DEVICE, DTYPES, ON_GPU, poison, rel_err, rel_norm

from canvasq.kernels.moe import (
    MoeLaunchConfig,
    W4Config,
    align_routing,
    align_routing_reference,
    load_packed,
    moe_reference,
    pack_model_experts,
    pack_w4,
    save_packed,
    unpack_w4,
    w4_moe,
    w4_moe_launch,
    w4_moe_reference,
)
from canvasq.kernels.moe.quant import max_abs_error_bound
from canvasq.kernels.moe.reference import route_weights

# kernel vs dequantised twin: same weights, only accumulation order and 16-bit roundings differ
TOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def _experts(E, H, I, dtype, seed, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(E, 2 * I, H, generator=g) * H**-0.5).to(dtype).to(device)
    down = (torch.randn(E, H, I, generator=g) * I**-0.5).to(dtype).to(device)
    return gate_up, down


def _routing(T, K, E, seed, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g).softmax(-1)
    return ids.to(device), w.to(device)


@pytest.mark.parametrize("H,I", [(256, 64), (200, 88), (128, 40)])
def test_pack_unpack_error_bounded(H, I):
    gate_up, down = _experts(4, H, I, torch.float32, seed=H + I, device="cpu")
    for sdt in (torch.float16, torch.bfloat16):
        p = pack_w4(gate_up, down, W4Config(scale_dtype=sdt))
        gu, dn = unpack_w4(p, torch.float32)
        bg, bd = max_abs_error_bound(p)
        assert gu.shape == gate_up.shape and dn.shape == down.shape
        assert ((gu - gate_up).abs() <= bg).all()
        assert ((dn - down).abs() <= bd).all()
        # 16 levels over a Gaussian group's ~5.2 sigma range: step ~0.35 sigma, mean error a quarter
        # step ~0.09 sigma against mean |w| ~0.8 sigma -> ~11 %
        assert (gu - gate_up).abs().mean() / gate_up.abs().mean() < 0.13
        assert (dn - down).abs().mean() / down.abs().mean() < 0.13


def test_pack_layout_matches_docstring():
    """w[e, n, k] == (nibble - zero) * scale with the nibble where quant.py's docstring says it is."""
    E, H, I = 2, 256, 64
    gate_up, down = _experts(E, H, I, torch.float32, seed=3, device="cpu")
    p = pack_w4(gate_up, down, W4Config(scale_dtype=torch.float32))
    gu, dn = unpack_w4(p, torch.float32)
    for w, q, s, z, G in (
        (gu, p.gate_up_q, p.gate_up_scale, p.gate_up_zero, 128),
        (dn, p.down_q, p.down_scale, p.down_zero, 64),
    ):
        for e, n, k in ((0, 0, 0), (1, 5, G // 2 - 1), (1, 7, G // 2), (0, 3, G + 5), (1, 1, w.shape[2] - 1)):
            if k >= w.shape[2]:
                continue
            g, j = divmod(k, G)
            byte = int(q[e, n, g * G // 2 + (j % (G // 2))])
            nib = (byte >> 4) if j >= G // 2 else (byte & 0xF)
            assert w[e, n, k] == (nib - z[e, g, n]) * s[e, g, n]
    assert ((p.gate_up_zero == p.gate_up_zero.round()) & (p.gate_up_zero >= 0) & (p.gate_up_zero <= 15)).all()


def test_zero_and_constant_groups_are_exact():
    gate_up = torch.zeros(1, 2 * 64, 128)
    gate_up[0, 1] = 0.25  # a constant non-zero row: representable exactly (0 and max are both levels)
    down = torch.zeros(1, 128, 64)
    gu, dn = unpack_w4(pack_w4(gate_up, down, W4Config(scale_dtype=torch.float32)), torch.float32)
    assert torch.equal(gu, gate_up) and torch.equal(dn, down)


@pytest.mark.parametrize("T,K,E", [(1, 2, 4), (5, 4, 16), (33, 8, 16), (70, 4, 128), (40, 8, 8)])
@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_routing_invariants(T, K, E, impl):
    ids, _ = _routing(T, K, E, seed=T * K)
    m = (align_routing if impl == "triton" else align_routing_reference)(ids, E, block_m=32)
    A = T * K
    sid = m.sorted_ids.cpu().long()
    P = int(m.num_padded.item())
    flat = ids.reshape(-1).cpu()
    counts = torch.bincount(flat, minlength=E)
    padded = (counts + 31) // 32 * 32
    assert torch.equal(m.counts.cpu().long(), counts)
    assert P == int(padded.sum()) and P % 32 == 0 and P <= sid.numel()
    assert (sid[P:] == A).all(), "rows past the end are sentinels"
    real = sid[:P][sid[:P] < A]
    assert torch.equal(real.sort().values, torch.arange(A)), "every assignment exactly once"
    be = m.block_expert.cpu().long()
    assert be.numel() == sid.numel() // 32
    for b in range(P // 32):
        rows = sid[b * 32 : (b + 1) * 32]
        rows = rows[rows < A]
        assert rows.numel() > 0, "no all-padding block inside P"
        assert (flat[rows] == be[b]).all(), "a block holds one expert's rows"
        assert (rows.diff() > 0).all(), "stable: rows of an expert in assignment order"
    # each expert's run starts on a block boundary and is padded to a multiple of 32
    starts = torch.cumsum(padded, 0) - padded
    for e in range(E):
        run = sid[starts[e] : starts[e] + padded[e]]
        assert (run[: counts[e]] < A).all() and (run[counts[e] :] == A).all()


@pytest.mark.parametrize("block_m", [16, 32, 64])
@pytest.mark.parametrize(
    "T,K,E",
    [
        (60, 8, 64),  # one one-hot tile per chunk, 15 chunks: one step of the histogram sum
        # 4,104 assignments: 33 chunks of 128 (3 steps of 16 histogram rows), each ranked in 4 one-hot
        # tiles (2 at block_m 64); the last chunk holds 8 (a part-filled tile, then empty ones); more
        # align programs than chunks (the rest write padding only). The paths of the two large cases
        # below at a quarter of the smaller one's work (the interpreter's time grows with it).
        (513, 8, 128),
        # 16,000: 63 chunks of 256 (4 histogram steps), 8 one-hot tiles each (4 at block_m 64)
        pytest.param(2000, 8, 128, marks=pytest.mark.large),
        # 72,000: chunks of 2,048 (the histogram bound), 64 one-hot tiles each (32 at block_m 64)
        pytest.param(9000, 8, 128, marks=pytest.mark.large),
        (50, 3, 300),  # E past 256: narrower one-hot tiles
    ],
)
def test_routing_kernel_matches_twin(block_m, T, K, E):
    ids, _ = _routing(T, K, E, seed=block_m)
    a, b = align_routing(ids, E, block_m), align_routing_reference(ids, E, block_m)
    assert torch.equal(a.sorted_ids, b.sorted_ids) and torch.equal(a.counts, b.counts)
    assert torch.equal(a.num_padded, b.num_padded) and torch.equal(a.block_expert, b.block_expert)


@pytest.mark.parametrize("T,K,E", [(37, 8, 128), (300, 8, 128), (50, 3, 300), (5, 2, 8)])
def test_fp8_expert_order_methods_give_torchs_stable_sort(T, K, E):
    """The FP8 experts' routing by every method (the counting sort of `align_routing` at one-row
    blocks, the narrow-key sort, the int64 sort) gives torch's stable sort's order, the same expert
    ends and the same inverse: the FP8 layer's rows and outputs are unchanged, bit for bit. Ids with
    repeats across tokens and experts nobody picked; E = 300 takes two-byte keys."""
    from canvasq.model.fp8 import ORDERS, _key_dtype, expert_order

    ids, _ = _routing(T, K, E, seed=T + E)
    ids[: T // 2] = ids[T // 2 : 2 * (T // 2)]  # many equal ids: the stable order is what is tested
    twin = expert_order(ids, E, kernel=False)
    assert _key_dtype(E) == (torch.uint8 if E <= 255 else torch.int16)
    for method in (*ORDERS, None):  # None: the kernel path's default ("chunks")
        got = expert_order(ids, E, kernel=True, method=method)
        for a, b in zip(got, twin):
            assert a.dtype == b.dtype and torch.equal(a, b), method
    order, _, row_of = twin
    assert torch.equal(order[row_of], torch.arange(T * K, device=ids.device))


CASES = [  # T not a multiple of 32, I = 64 (testbed) and 88 (704 / 8), H not a multiple of 128
    (7, 2, 8, 256, 64),
    (37, 4, 16, 256, 64),
    (19, 8, 16, 128, 88),
    (3, 8, 32, 200, 40),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,K,E,H,I", CASES)
def test_w4_moe_matches_dequantised(T, K, E, H, I, dtype):
    if not ON_GPU and (T, K, E, H, I) != CASES[1] and dtype == torch.float16:
        pytest.skip("interpreter time: fp16 runs on one case on CPU")
    gate_up, down = _experts(E, H, I, dtype, seed=T + K + E)
    packed = pack_w4(gate_up, down)
    x = torch.randn(T, H, device=DEVICE).to(dtype)
    ids, w = _routing(T, K, E, seed=T)
    out = poison((T, H), dtype)
    y = w4_moe_launch(x, ids, w, packed, out=out)
    assert y.data_ptr() == out.data_ptr() and torch.isfinite(y).all()
    ref = w4_moe_reference(x, ids, w, packed)
    assert rel_err(y, ref) < TOL[dtype], rel_err(y, ref)
    # and quantisation keeps it near the unquantised layer (loose: W4 is not lossless)
    full = moe_reference(x.float(), ids, w, gate_up.float(), down.float())
    assert rel_norm(y, full) < 0.25, rel_norm(y, full)  # ~0.1 per weight through two layers; garbage ~1.4


def test_w4_moe_deterministic_and_block_sizes():
    T, K, E, H, I = 21, 4, 8, 128, 64
    gate_up, down = _experts(E, H, I, torch.float16, seed=11)
    packed = pack_w4(gate_up, down)
    x = torch.randn(T, H, device=DEVICE).half()
    ids, w = _routing(T, K, E, seed=5)
    a = w4_moe_launch(x, ids, w, packed)
    b = w4_moe_launch(x, ids, w, packed, out=poison((T, H), torch.float16))
    assert torch.equal(a, b), "reruns must be bit-identical"
    other = MoeLaunchConfig(block_m=16, gate_up_block_n=32, down_block_n=128, combine_block_n=128)
    c = w4_moe_launch(x, ids, w, packed, config=other)
    assert rel_err(c, a) < TOL[torch.float16]


def test_public_entry_points():
    T, K, E, H, I = 6, 2, 4, 128, 64
    gate_up, down = _experts(E, H, I, torch.float32, seed=1)
    packed = pack_w4(gate_up, down)
    x = torch.randn(T, H, device=DEVICE)
    ids, w = _routing(T, K, E, seed=2)
    ref = w4_moe(x, ids, w, packed, impl="torch")
    assert torch.equal(ref, w4_moe_reference(x, ids, w, packed))
    assert rel_err(w4_moe(x, ids, w, packed, impl="triton"), ref) < TOL[torch.float32]
    with pytest.raises(ValueError):
        w4_moe(x, ids, w, packed, impl="nope")


@pytest.mark.parametrize("K", [3, 8])
def test_combine_applies_the_router_epilogue(K):
    """Raw top-k probabilities + expert_scale: the combine renormalises and scales in-kernel, as
    `route_weights` does in torch (the runtime's twin path), and that changes the result."""
    T, E, H, I = 7, 9, 128, 64
    gate_up, down = _experts(E, H, I, torch.float32, seed=5)
    packed = pack_w4(gate_up, down)
    x = torch.randn(T, H, device=DEVICE)
    g = torch.Generator().manual_seed(6)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(DEVICE)
    p = torch.rand(T, K, generator=g).to(DEVICE) * 0.3  # unnormalised, as topk of a softmax
    scale = (torch.rand(E, generator=g) + 0.5).to(DEVICE)
    got = w4_moe(x, ids, p, packed, impl="triton", expert_scale=scale)
    want = w4_moe_reference(x, ids, route_weights(p, ids, scale), packed)
    assert rel_err(got, want) < TOL[torch.float32]
    assert torch.equal(w4_moe(x, ids, p, packed, impl="torch", expert_scale=scale), want)
    assert rel_err(w4_moe(x, ids, p, packed, impl="triton"), want) > 0.1  # without it: raw weights


def test_save_load_roundtrip(tmp_path):
    gate_up, down = _experts(3, 128, 64, torch.float16, seed=4, device="cpu")
    packed = pack_w4(gate_up, down)
    path = tmp_path / "w4.safetensors"
    save_packed(path, {"layers.0.experts": packed}, {"layers.0.experts": ["a.experts", "b.experts"]})
    packs, owners = load_packed(path)
    got = packs["layers.0.experts"]
    assert owners == {"layers.0.experts": ["a.experts", "b.experts"]}
    assert (got.hidden, got.inter, got.config) == (packed.hidden, packed.inter, packed.config)
    for k, t in packed.tensors().items():
        assert torch.equal(got.tensors()[k], t), k


def test_stale_layout_file_is_refused_and_repacked(tmp_path):
    """A cache written for the first nibble layout ([E, Kp/2, N], no `layout` key) must not load as if
    it were today's [E, N, Kp/2] (same bytes, other weights); pack_model_experts repacks over it."""
    import json

    from safetensors import safe_open
    from safetensors.torch import save_file

    from canvasq.kernels.moe.store import StalePackError

    gate_up, down = _experts(2, 128, 64, torch.float32, seed=5, device="cpu")
    packed = pack_w4(gate_up, down)
    path = tmp_path / "old.safetensors"
    save_packed(path, {"m.experts": packed})
    with safe_open(str(path), framework="pt") as f:
        meta = json.loads(f.metadata()["canvasq_w4"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    del meta["m.experts"]["layout"]
    save_file(tensors, str(path), metadata={"canvasq_w4": json.dumps(meta)})
    with pytest.raises(StalePackError, match="layout"):
        load_packed(path)

    class Experts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_up_proj = torch.nn.Parameter(gate_up.clone())
            self.down_proj = torch.nn.Parameter(down.clone())

    model = torch.nn.Module()
    model.m = torch.nn.Module()
    model.m.experts = Experts()
    packs = pack_model_experts(model, cache=path)  # repacks, rewrites the file
    for k, t in packed.tensors().items():
        assert torch.equal(packs["m.experts"].tensors()[k], t), k
    assert torch.equal(load_packed(path)[0]["m.experts"].gate_up_q, packed.gate_up_q)


def test_pack_model_experts_testbed(tmp_path, monkeypatch):
    """In-place packing of the testbed-shaped HF model: shared encoder/decoder experts packed once,
    every experts module routed through w4_moe, a cache file reproduces the packing exactly."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # `impl="auto"` on CPU: the torch twin
    from transformers import DiffusionGemmaForBlockDiffusion

    from canvasq.model.shapes import build_config

    def fresh():
        torch.manual_seed(0)
        return DiffusionGemmaForBlockDiffusion._from_config(build_config(), dtype=torch.float32).eval()

    model = fresh()
    experts = [
        (n, m) for n, m in model.named_modules() if hasattr(m, "gate_up_proj") and hasattr(m, "down_proj")
    ]
    assert experts
    name0, mod0 = experts[0]
    gu0, dn0 = mod0.gate_up_proj.detach().clone(), mod0.down_proj.detach().clone()
    n_distinct = len({id(m.gate_up_proj) for _, m in experts})
    cache = tmp_path / "testbed_w4.safetensors"
    packs = pack_model_experts(model, cache=cache)
    assert len(packs) == n_distinct and cache.exists()
    assert all(hasattr(m, "w4_experts") and "gate_up_proj" not in m._parameters for _, m in experts)

    T, H = 9, gu0.shape[2]
    x = torch.randn(T, H)
    ids, w = _routing(T, 4, gu0.shape[0], seed=9, device="cpu")
    y = mod0(x, ids, w)  # patched forward -> w4_moe (torch twin on CPU)
    gq, dq = unpack_w4(mod0.w4_experts, torch.float32)
    assert torch.equal(y, moe_reference(x, ids, w, gq, dq))
    assert rel_norm(y, moe_reference(x, ids, w, gu0, dn0)) < 0.25

    model2 = fresh()
    pack_model_experts(model2, cache=cache)  # loads, does not repack
    mod2 = dict(model2.named_modules())[name0]
    assert torch.equal(mod2(x, ids, w), y)


def test_random_build_makes_meta_experts_a_layer_at_a_time(monkeypatch):
    """`build_random(experts_on_meta=True)` leaves every experts module on the meta device, tied as
    HF ties them, and builds everything else as usual; packing asks `materialize` once per tied group,
    never holding two groups' BF16 experts at once, and the packed experts are what it made."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    from canvasq.model import loading

    model = loading.build_random("testbed", "cpu", torch.float32, experts_on_meta=True)
    experts = [m for _, m in model.named_modules() if hasattr(m, "gate_up_proj") and hasattr(m, "down_proj")]
    assert experts and all(m.gate_up_proj.is_meta and m.down_proj.is_meta for m in experts)
    assert not any(p.is_meta for n, p in model.named_parameters() if ".experts." not in n)
    assert all(not b.is_meta for b in model.buffers())  # RoPE frequencies, scalars: built as usual
    groups = {id(m.gate_up_proj) for m in experts}
    with pytest.raises(ValueError, match="materialize"):
        pack_model_experts(model, device="cpu")

    made, live = [], []

    def materialize(meta, device):
        live.append(meta.shape)
        t = torch.randn(meta.shape, dtype=meta.dtype, device=device) * 0.02
        made.append(t)
        return t

    real_pack = pack_model_experts.__globals__["pack_w4"]

    def pack_w4_spy(gate_up, down, config=None):
        assert len(live) == 2, "one group's gate_up and down are made, then packed"
        live.clear()
        return real_pack(gate_up, down, config)

    monkeypatch.setitem(pack_model_experts.__globals__, "pack_w4", pack_w4_spy)
    packs = pack_model_experts(model, device="cpu", materialize=materialize)
    assert len(packs) == len(groups) and len(made) == 2 * len(groups)
    gq, _ = unpack_w4(next(iter(packs.values())), torch.float32)
    assert rel_norm(gq, made[0]) < 0.25  # the pack holds the values made for it


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
def test_w4_moe_real_shape_bf16():
    E, H, I, K, T = 128, 2816, 704, 8, 256
    gate_up, down = _experts(E, H, I, torch.bfloat16, seed=0)
    packed = pack_w4(gate_up, down)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    ids, w = _routing(T, K, E, seed=1)
    y = w4_moe_launch(x, ids, w, packed, out=poison((T, H), torch.bfloat16))
    ref = w4_moe_reference(x, ids, w, packed)
    assert rel_err(y, ref) < TOL[torch.bfloat16]
    assert torch.equal(y, w4_moe_launch(x, ids, w, packed))
    tiled = packed.to_tiled()  # the Gluon kernels with the tuned H200 tiles (elsewhere: the defaults)
    y_gl = w4_moe_launch(x, ids, w, tiled, out=poison((T, H), torch.bfloat16))
    assert rel_err(y_gl, ref) < TOL[torch.bfloat16] and rel_err(y_gl, y) < TOL[torch.bfloat16]
    assert torch.equal(y_gl, w4_moe_launch(x, ids, w, tiled))


def test_tiled_pack_round_trips_and_serves_the_twin(tmp_path):
    """`to_tiled` keeps the same nibbles in the Gluon order: the K-contiguous bytes come back exactly,
    the twin and a saved file see the same weights, and a tiled pack refuses the Triton kernels
    with a clear error where the Gluon ones cannot run (here: CPU)."""
    from canvasq.kernels.moe.launch import prefer_tiled, tiled_runnable

    E, H, I, K, T = 4, 256, 64, 2, 7
    gate_up, down = _experts(E, H, I, torch.float32, seed=4, device="cpu")
    packed = pack_w4(gate_up, down, W4Config(scale_dtype=torch.float16))
    tiled = packed.to_tiled()
    assert tiled.tiled and not packed.tiled and tiled.to_tiled() is tiled
    assert tiled.gate_up_q.dtype == torch.int32
    words = 4 * (packed.gate_up_scale.numel() + packed.down_scale.numel())  # the packed scale/zero words
    assert tiled.nbytes() == packed.nbytes() + words
    for a, b in zip(tiled.kcontig_q(), (packed.gate_up_q, packed.down_q)):
        assert torch.equal(a, b)
    for a, b in zip(unpack_w4(tiled), unpack_w4(packed)):
        assert torch.equal(a, b)
    x = torch.randn(T, H).half()
    ids, w = _routing(T, K, E, seed=5, device="cpu")
    ref = w4_moe_reference(x, ids, w, packed)
    assert torch.equal(w4_moe_reference(x, ids, w, tiled), ref)
    assert not tiled_runnable(tiled, x.dtype) and prefer_tiled(packed) is packed  # CPU: no Gluon
    assert torch.equal(w4_moe(x, ids, w, tiled), ref)  # "auto" falls back to the twin
    with pytest.raises(ValueError, match="tiled for the Gluon kernels"):
        w4_moe_launch(x, ids, w, tiled)
    save_packed(tmp_path / "t.safetensors", {"m": tiled})
    loaded = load_packed(tmp_path / "t.safetensors")[0]["m"]
    assert not loaded.tiled and torch.equal(loaded.gate_up_q, packed.gate_up_q)
    odd = pack_w4(
        *_experts(2, 200, 88, torch.float32, seed=6, device="cpu"), W4Config(scale_dtype=torch.float16)
    )
    with pytest.raises(ValueError, match="whole groups"):
        odd.to_tiled()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_packed_scale_zero_words(dtype):
    """`pack_scale_zero`: the low half is the scale's bits, the high half -(magic + zero) in the same
    dtype (what the PTX adds to magic + q), exactly; `unpack_scale_zero` inverts it, and a tiled pack
    carries the words of its own scales and zeros."""
    from canvasq.kernels.moe.gluon_pack import MAGIC, pack_scale_zero, unpack_scale_zero

    g = torch.Generator().manual_seed(3)
    scale = (torch.rand(2, 3, 40, generator=g) * 0.1 + 1e-4).to(dtype)
    zero = torch.randint(0, 16, (2, 3, 40), generator=g).to(dtype)
    sz = pack_scale_zero(scale, zero)
    assert sz.dtype == torch.int32 and sz.shape == scale.shape
    lo = (sz & 0xFFFF).to(torch.int32)
    hi = ((sz >> 16) & 0xFFFF).to(torch.int32)
    as_dtype = lambda v: torch.where(v >= 2**15, v - 2**16, v).to(torch.int16).view(dtype)
    assert torch.equal(as_dtype(lo), scale)
    assert torch.equal(as_dtype(hi).float(), -(zero.float() + MAGIC[dtype]))
    s2, z2 = unpack_scale_zero(sz, dtype)
    assert torch.equal(s2, scale) and torch.equal(z2, zero)
    packed = pack_w4(*_experts(2, 128, 64, torch.float32, seed=8, device="cpu"), W4Config(scale_dtype=dtype))
    tiled = packed.to_tiled()
    assert torch.equal(tiled.gate_up_sz, pack_scale_zero(packed.gate_up_scale, packed.gate_up_zero))
    assert torch.equal(tiled.down_sz, pack_scale_zero(packed.down_scale, packed.down_zero))
    with pytest.raises(ValueError, match="fp16/bf16"):
        pack_w4(*_experts(2, 128, 64, torch.float32, seed=8, device="cpu")).to_tiled()


def test_gluon_tile_narrows_to_divide():
    from canvasq.kernels.moe.launch import gluon_tile, routing_block

    packed = pack_w4(
        *_experts(2, 128, 64, torch.float32, seed=7, device="cpu"), W4Config(scale_dtype=torch.float16)
    )
    cfg = MoeLaunchConfig(block_m=16, gluon_block_m=32)
    assert routing_block(cfg, packed) == 16 and routing_block(cfg, packed.to_tiled()) == 32
    assert routing_block(MoeLaunchConfig(block_m=16), packed.to_tiled()) == 16

    assert gluon_tile(2, 2, 704) == (2, 2)  # 64 | 704
    assert gluon_tile(4, 2, 704) == (4, 1)  # 128 does not divide 704 = 11 * 64
    assert gluon_tile(8, 1, 48) == (1, 1)


def test_tuned_config_lookup(tmp_path, monkeypatch):
    from canvasq.kernels.moe.config import get_config, save_configs

    packed = pack_w4(*_experts(2, 128, 64, torch.float32, seed=0, device="cpu"))
    path = tmp_path / "tuned.json"
    save_configs(path, {8: MoeLaunchConfig(gate_up_block_n=32), 256: MoeLaunchConfig(down_block_n=256)}, {})
    monkeypatch.setenv("CANVASQ_MOE_CONFIG_FILE", str(path))
    assert get_config(5, 8, packed, torch.float32).gate_up_block_n == 32  # smallest bucket >= rows
    assert get_config(9, 8, packed, torch.float32).down_block_n == 256
    assert get_config(10_000, 8, packed, torch.float32).down_block_n == 256  # past the end: largest
    monkeypatch.setenv("CANVASQ_MOE_CONFIG", '{"block_m": 16}')
    assert get_config(5, 8, packed, torch.float32) == MoeLaunchConfig(block_m=16)
    monkeypatch.delenv("CANVASQ_MOE_CONFIG")
    monkeypatch.delenv("CANVASQ_MOE_CONFIG_FILE")
    assert get_config(5, 8, packed, torch.float32) == MoeLaunchConfig()  # no file for cpu: defaults


def _half_float(bits: int, dtype: torch.dtype) -> float:
    return torch.tensor([bits], dtype=torch.int32).to(torch.int16).view(dtype).float().item()


def _float_half(v: float, dtype: torch.dtype) -> int:
    return torch.tensor([v], dtype=dtype).view(torch.int16).to(torch.int32).item() & 0xFFFF


def _run_ptx(program: str, inp: int, extra: dict[str, int] | None = None) -> dict[str, int]:
    """A tiny interpreter for the PTX instructions the dequantisation programs use (prmt in its default
    mode, shr.u32, lop3.b32 with an immediate truth table, mov.b32 and fma.rn on bf16x2/f16x2 pairs,
    rounded through torch), on 32-bit registers; $4 is the input word, `extra` more inputs."""
    regs = {"$4": inp, **(extra or {})}
    val = lambda tok: int(tok, 16) if tok.startswith("0x") else (int(tok) if tok.isdigit() else regs[tok])
    for line in program.splitlines():
        line = line.strip().rstrip(";")
        if not line or line[0] in "{}." or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        d, *src = [a.strip() for a in args.split(",")]
        if op == "prmt.b32":
            a, b, sel = (val(t) for t in src)
            pool = (b << 32) | a  # bytes 0-3 from a, 4-7 from b
            regs[d] = sum(((pool >> (8 * ((sel >> (4 * i)) & 7))) & 0xFF) << (8 * i) for i in range(4))
        elif op == "shr.u32":
            regs[d] = val(src[0]) >> val(src[1])
        elif op == "mov.b32":
            regs[d] = val(src[0])
        elif op in ("fma.rn.bf16x2", "fma.rn.f16x2"):
            dt = torch.bfloat16 if op.endswith("bf16x2") else torch.float16
            a, b, c = (val(t) for t in src)
            halves = []
            for h in range(2):
                fa, fb, fc = (_half_float((r >> (16 * h)) & 0xFFFF, dt) for r in (a, b, c))
                halves.append(_float_half(fa * fb + fc, dt))  # exact here: small integers
            regs[d] = halves[0] | (halves[1] << 16)
        elif op == "lop3.b32":
            a, b, c, lut = (val(t) for t in src)
            regs[d] = sum(
                ((lut >> (((a >> k) & 1) << 2 | ((b >> k) & 1) << 1 | ((c >> k) & 1))) & 1) << k
                for k in range(32)
            )
        else:
            raise AssertionError(f"unexpected instruction {op}")
    return regs


@pytest.mark.parametrize("dtype,magic", [(torch.bfloat16, 128.0), (torch.float16, 1024.0)])
def test_nibble_ptx_gives_the_magic_values(dtype, magic):
    """The GPU-only dequantisation (kernels.py `_NIBBLES_PTX`, DEQUANT 4/5) read instruction by
    instruction: every byte value in every lane of the word must give (magic + low nibble,
    magic + high nibble) in the order Triton packs four uint8 elements into $4 and two 16-bit
    results into each of $0/$1 (low nibbles) and $2/$3 (high nibbles)."""
    import numpy as np

    from canvasq.kernels.moe import kernels as K

    program = (K._NIBBLES_BF16 if dtype == torch.bfloat16 else K._NIBBLES_FP16).value
    g = torch.Generator().manual_seed(0)
    for byte in range(256):
        for lane in range(4):
            word = [int(v) for v in torch.randint(0, 256, (4,), generator=g)]
            word[lane] = byte
            regs = _run_ptx(program, sum(b << (8 * i) for i, b in enumerate(word)))
            halves = [(regs[f"${r}"] >> (16 * h)) & 0xFFFF for r in range(4) for h in range(2)]
            got = torch.from_numpy(np.array(halves, dtype=np.uint16).view(np.int16)).view(dtype).float()
            want = [magic + (b & 0xF) for b in word] + [magic + (b >> 4) for b in word]
            assert got.tolist() == want, (byte, lane, word)


def test_gluon_tiling_round_trips_and_orders_k():
    """`tile_q` is a permutation of the K-contiguous bytes (untile inverts it), and each tiled word
    holds the 8 logical k its lane's MMA registers take (real k by `mma_k`), in `NIBBLE_K` order."""
    from canvasq.kernels.moe.gluon_pack import NIBBLE_K, mma_k, tile_q, untile_q

    g = torch.Generator().manual_seed(0)
    for group in (64, 128):
        real = mma_k(group)
        assert sorted(real.tolist()) == list(range(group))  # a permutation of the group's k
        # one MMA takes logical pairs 4c + i and 16 + 4c + i of a 64-k block: real pairs side by side
        for blk in range(group // 64):
            for c in range(4):
                for i in range(4):
                    lo, hi = 32 * blk + 4 * c + i, 32 * blk + 16 + 4 * c + i
                    assert int(real[2 * hi]) == int(real[2 * lo]) + 2 == 64 * blk + 16 * c + 4 * i + 2
    for group, n, kb in ((128, 32, 128), (64, 48, 96)):
        q = torch.randint(0, 256, (3, n, kb), generator=g, dtype=torch.int32).to(torch.uint8)
        qt = tile_q(q, group)
        assert qt.dtype == torch.int32 and qt.shape == (3, n // 16, kb // (group // 2), 2 * group)
        assert torch.equal(untile_q(qt, group), q)
        hb, nh = group // 2, group // 32
        e, tile, grp, rr, gg, c, h = 2, 1, 1, 1, 5, 3, nh - 1
        word = int(qt[e, tile, grp, 32 * nh * rr + nh * (4 * gg + c) + h])
        row = q[e, 16 * tile + 8 * rr + gg, grp * hb : (grp + 1) * hb].tolist()
        nib = [b & 0xF for b in row] + [b >> 4 for b in row]  # k = j, HB + j
        for n_ in range(8):
            assert (word >> (4 * n_)) & 0xF == nib[int(mma_k(group)[32 * h + 8 * c + NIBBLE_K[n_]])]


@pytest.mark.parametrize("dtype,magic", [(torch.bfloat16, 128.0), (torch.float16, 1024.0)])
def test_word_ptx_gives_weights_in_pair_order(dtype, magic):
    """The Gluon kernels' dequantisation (gluon_pack `_WORD_PTX`) read instruction by instruction: a word
    of 8 nibbles and a row's -(magic + zero) pair give $i = (k 2i, k 2i + 1) of q - zero, exactly."""
    from canvasq.kernels.moe.gluon_pack import NIBBLE_K, WORD_PTX_BF16, WORD_PTX_FP16

    program = WORD_PTX_BF16 if dtype == torch.bfloat16 else WORD_PTX_FP16
    g = torch.Generator().manual_seed(0)
    for _ in range(300):
        word = int(torch.randint(0, 2**32, (1,), generator=g, dtype=torch.int64))
        zero = int(torch.randint(0, 16, (1,), generator=g))
        nz = _float_half(-(magic + zero), dtype)
        regs = _run_ptx(program, word, {"$5": nz | (nz << 16)})
        k_of = {k: (word >> (4 * n)) & 0xF for n, k in enumerate(NIBBLE_K)}
        for i in range(4):
            got = [_half_float((regs[f"${i}"] >> (16 * h)) & 0xFFFF, dtype) for h in range(2)]
            assert got == [k_of[2 * i] - zero, k_of[2 * i + 1] - zero], (word, zero, i)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_m,T,stages", [(16, 37, 0), (32, 200, 0), (16, 37, 3), (32, 200, 4)])
def test_gluon_kernels_match_triton_kernels(dtype, block_m, T, stages):
    """The Gluon gate_up/down (gluon_w4.py, on the tiled pack) against the Triton ones (on the
    K-contiguous pack) and the dequantised twin; CUDA packs are tiled by default (`prefer_tiled`)."""
    from canvasq.kernels.moe.launch import prefer_tiled

    E, H, I, K = 8, 256, 128, 4
    gate_up, down = _experts(E, H, I, dtype, seed=0)
    packed = pack_w4(gate_up, down)
    tiled = prefer_tiled(packed)
    assert tiled.tiled
    x = torch.randn(T, H, device="cuda", dtype=dtype)
    ids, w = _routing(T, K, E, seed=1)
    cfg = MoeLaunchConfig(
        block_m=block_m, gluon_gate_up_tiles=2, gluon_gate_up_stages=stages, gluon_down_stages=stages
    )
    y = w4_moe_launch(x, ids, w, tiled, config=cfg, out=poison((T, H), dtype))
    y_triton = w4_moe_launch(x, ids, w, packed, config=MoeLaunchConfig(block_m=block_m))
    ref = w4_moe_reference(x, ids, w, packed)
    assert rel_err(y, ref) < TOL[dtype]
    assert rel_err(y, y_triton) < TOL[dtype]
    assert torch.equal(y, w4_moe_launch(x, ids, w, tiled, config=cfg))
    if block_m == 16:  # the Gluon kernels' own routing block (the Triton tiles keep block_m)
        y32 = w4_moe_launch(x, ids, w, tiled, config=replace(cfg, gluon_block_m=32))
        assert rel_err(y32, ref) < TOL[dtype]
    x_odd = torch.randn(T, H + 1, device="cuda", dtype=dtype)[:, 1:]  # 2-byte aligned rows: copied
    assert torch.equal(
        w4_moe_launch(x_odd, ids, w, tiled, config=cfg),
        w4_moe_launch(x_odd.contiguous(), ids, w, tiled, config=cfg),
    )
