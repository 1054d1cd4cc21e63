"""Triton rms_norm_rope vs its twin on the inputs the testbed decode actually feeds it (GPU, bf16/fp32)."""

import json
import os

import torch

from canvasq.kernels.norm_fused import rms_norm_rope_launch, rms_norm_rope_reference
from canvasq.model.loading import load_bundle
from canvasq.model.runtime import Runtime, Window

res = {}
for dt in (torch.bfloat16, torch.float32):
    m = load_bundle(device="cuda", dtype=dt).hf_model
    rt = Runtime.from_hf(m, kernels=True)
    calls = []

    def spy(x, w, cos=None, sin=None, eps=1e-6):
        y = rms_norm_rope_launch(x, w, cos, sin, eps)
        t = rms_norm_rope_reference(x, w, cos, sin, eps)
        d = (y.float() - t.float()).abs()
        calls.append(
            {
                "shape": list(x.shape),
                "stride": list(x.stride()),
                "rope": cos is not None,
                "w": w is not None,
                "maxdiff": float(d.max()),
                "ndiff": int((d > 0).sum()),
                "numel": y.numel(),
                "maxref": float(t.float().abs().max()),
                "cos_stride": list(cos.stride()) if cos is not None else None,
                "cos_shape": list(cos.shape) if cos is not None else None,
            }
        )
        return y

    rt._norm_rope = spy
    v, c = rt.vocab_size, m.config.canvas_length
    g = torch.Generator().manual_seed(4)
    b, p = 3, 40
    prompts = torch.randint(5, v, (b, p), generator=g).cuda()
    canvas = torch.randint(5, v, (b, c), generator=g).cuda()
    with torch.no_grad():
        arena = rt.new_arena(b, 256)
        rt.encode_many(arena, [(i, prompts[i], torch.arange(p, device="cuda")) for i in range(b)])
        rt.decode(arena, [Window.canvas(i, canvas[i], p) for i in range(b)])
    res[str(dt)] = calls
    worst = sorted(calls, key=lambda c: -c["maxdiff"])[:4]
    print(dt, len(calls), json.dumps(worst))
json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "nr_check.json"), "w"), indent=1)
