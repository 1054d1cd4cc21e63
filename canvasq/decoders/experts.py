"""Expert weights per A/B arm: the BF16 experts as loaded, or the W4A16 experts swapped in.

The W4 arm is a second module tree that *shares* every tensor of the plain model (nothing is
copied) and has its experts modules packed by `canvasq.kernels.pack_model_experts`; the plain model
is untouched, so both arms run in one process (BENCHMARKS.md, "W4 experts and the entropy bound").
"""

from __future__ import annotations

import weakref

_W4_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # plain model -> its W4 twin


def model_with_experts(hf_model, experts: str):
    """`hf_model` itself for "bf16"; a cached W4 twin for "w4"."""
    if experts == "bf16":
        return hf_model
    if experts != "w4":
        raise ValueError(f"experts must be 'bf16' or 'w4', got {experts!r}")
    if hf_model not in _W4_CACHE:
        _W4_CACHE[hf_model] = _build_w4(hf_model)
    return _W4_CACHE[hf_model]


def _build_w4(hf_model):
    import copy
    import itertools

    from canvasq.kernels import pack_model_experts

    # share every parameter and buffer: the deep copy only duplicates the module objects
    memo = {id(t): t for t in itertools.chain(hf_model.parameters(), hf_model.buffers())}
    twin = copy.deepcopy(hf_model, memo)
    pack_model_experts(twin)  # replaces the twin's experts forward; the plain model keeps BF16
    return twin.eval()
