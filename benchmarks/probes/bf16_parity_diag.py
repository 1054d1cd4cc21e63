"""Where does the bf16 kernel path leave HF? Testbed (trained) and a 6-layer real-shape model."""

import json
import os

import torch
from transformers import DiffusionGemmaForBlockDiffusion, DynamicCache

from canvasq.kernels.norm_fused import add_rms_norm_reference, rms_norm_rope_reference
from canvasq.kernels.rmsnorm import rms_norm_reference
from canvasq.model.loading import load_bundle
from canvasq.model.runtime import Runtime, Window
from canvasq.model.shapes import REAL_26B_A4B, build_config


def rel(a, b):
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def agree(a, b):
    return float((a.argmax(-1) == b.argmax(-1)).float().mean())


@torch.no_grad()
def run(m, tag, b, p, r, seed):
    v = m.config.get_text_config().vocab_size
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(5, v, (b, p), generator=g).cuda()
    canvas = torch.randint(5, v, (b, r), generator=g).cuda()
    pos = torch.arange(p, p + r, device="cuda")[None].expand(b, r)

    def hf():
        cache = DynamicCache(config=m.config.get_text_config())
        m.model.encoder(
            input_ids=prompts,
            position_ids=torch.arange(p, device="cuda")[None].expand(b, p),
            past_key_values=cache,
        )
        return m(decoder_input_ids=canvas, past_key_values=cache, decoder_position_ids=pos).logits.reshape(
            b * r, -1
        )

    ref = hf()
    out = {}
    try:
        m.set_attn_implementation("eager")
        out["hf_eager_vs_sdpa"] = rel(hf(), ref)
        m.set_attn_implementation("sdpa")
    except Exception as ex:
        out["hf_eager_err"] = repr(ex)[:200]

    def ours(kernels, patch=None, prefix=True, experts="bf16"):
        rt = Runtime.from_hf(m, kernels=kernels, experts=experts)
        rt.prefix_attention = prefix
        if patch:
            setattr(rt, patch[0], patch[1])
        arena = rt.new_arena(b, 512)
        rt.encode_many(arena, [(i, prompts[i], torch.arange(p, device="cuda")) for i in range(b)])
        lo = rt.decode(arena, [Window.canvas(i, canvas[i], p) for i in range(b)]).logits
        return rel(lo, ref), agree(lo, ref)

    out["twins"] = ours(False)
    out["twins_masked"] = ours(False, prefix=False)
    out["kernels"] = ours(True)
    out["kernels_norm_twin"] = ours(True, ("_norm", rms_norm_reference))
    out["kernels_norm_rope_twin"] = ours(True, ("_norm_rope", rms_norm_rope_reference))
    out["kernels_add_norm_twin"] = ours(True, ("_add_norm", add_rms_norm_reference))
    print(tag, json.dumps(out), flush=True)
    return out


res = {}
m = load_bundle(device="cuda", dtype=torch.bfloat16).hf_model
res["testbed"] = run(m, "testbed", 3, 40, m.config.canvas_length, 4)
del m
torch.manual_seed(0)
with torch.device("cuda"):
    m = DiffusionGemmaForBlockDiffusion._from_config(
        build_config(REAL_26B_A4B.replace(num_hidden_layers=6)), dtype=torch.bfloat16
    ).eval()
res["real6"] = run(m, "real6", 2, 128, 64, 1)
json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "diag.json"), "w"), indent=1)
