"""The process's decoder runtimes: one `model.runtime.Runtime` per (model, experts, FP8 setting,
encoder model), built on first ask (`runtime_for`) and shared by every decoder of that key. The worker's
`Engine.warm` asks for the default route's at start; benchmarks read the table to set runtime knobs."""

from __future__ import annotations

import weakref

# model -> {experts: Runtime}; weak keys, so a freed model never hands its runtime to a new one
_RUNTIMES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def runtime_for(hf_model, experts: str, fp8: str = "off", fp8_min_rows: int = 0, encoder_model=None):
    """One `Runtime` per (model, experts, FP8 setting, encoder model) per process: it shares the HF
    tensors, W4 packs once; `fp8` ("auto", "off" or a list of `model.fp8.PARTS`) adds FP8 copies for
    large forwards; `encoder_model` gives the encoder passes other weights (`Runtime.from_hf`)."""
    from canvasq.model.fp8 import install_fp8, parse_parts
    from canvasq.model.runtime import Runtime

    per_model = _RUNTIMES.setdefault(hf_model, {})
    device = next(hf_model.parameters()).device
    parts = parse_parts(fp8, device)
    key = (experts, parts, fp8_min_rows if parts else 0, None if encoder_model is None else id(encoder_model))
    if key not in per_model:
        rt = Runtime.from_hf(hf_model, experts=experts, encoder_model=encoder_model)
        if parts:
            install_fp8(rt, parts, fp8_min_rows)
        per_model[key] = rt
    return per_model[key]
