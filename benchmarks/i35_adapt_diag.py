"""Issue 35 item 2: does a D2F adapter's HF replay of the decoders' recorded states match the runtime,
and how calibrated is it there? Train-split arith prompts the official sampler answers right, decoded by
one arm (recording, canvasq/testbed/adapt_data.py); each state is replayed through HF with no adapter,
the committed d2f_adapter and the given adapters: agreement with the runtime's argmax, argmax accuracy
against the teacher on open positions, and per bar τ the share of open positions at p(argmax) ≥ τ and
the share of those that are wrong.

    python3 benchmarks/i35_adapt_diag.py funnel '{"front": "revise", "retire_refresh": true}' ADAPTER...
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from canvasq.decoders.types import DecodeBatch, DecodeRequest
from canvasq.model.loading import load_bundle
from canvasq.testbed import adapt as A
from canvasq.testbed import adapt_data as D
from canvasq.testbed.train_loss import _decoder_kwargs, encode_context

BARS = (0.5, 0.6, 0.7, 0.8, 0.9, 0.95)


def record(bundle, name: str, over: dict):
    teachers, _ = D.teacher_answers(bundle, "arith", 24, 77, 24, lambda _: None)
    dec = D.recording_decoder(name, bundle, over, {t.uid: t for t in teachers}, 1.0, 0)
    runtime_arg: list[torch.Tensor] = []
    parent = type(dec).__mro__[1]

    def apply(s, parts, out, b):
        n0 = len(dec.states)
        dec.snapshot(s)
        if len(dec.states) > n0:  # the runtime's argmax per canvas position (-1: not riding)
            logits, base = out.window_logits(b).float(), 0
            arg = torch.full((sum(cv.length for cv in s.canvases),), -1)
            for cv in s.canvases:
                for p in parts:
                    if p.cv is cv:
                        arg[base + p.idx.cpu()] = logits[p.off : p.off + p.idx.numel()].argmax(-1).cpu()
                base += cv.length
            runtime_arg.append(arg)
        return parent._apply(dec, s, parts, out, b)

    dec._apply = apply
    dec.decode(DecodeBatch([DecodeRequest(t.uid, t.prompt, t.max_tokens, "arith") for t in teachers], seed=3))
    return dec.states, runtime_arg


def replay(bundle, states, runtime_arg, adapter: str | None) -> dict:
    model = A._student(bundle, A.AdaptSettings(out=Path("unused"), init=Path(adapter) if adapter else None))
    m = model.base_model.model.eval()
    C, V = bundle.canvas_length, bundle.config.text_config.vocab_size
    agree = ridden = 0
    conf, wrong = [], []
    with torch.no_grad():
        for st, ref in zip(states, runtime_arg):
            bt = D.collate([st], C, V, bundle.pad_id, 0.0, torch.Generator())
            kw = _decoder_kwargs(m, bt.ctx_mask, bt.tokens, encode_context(m, bt.ctx, bt.ctx_mask), bt.k, C)
            with A._sc_rows(m, bt.sc_rows if bt.sc is not None else None):
                p, arg = m(**kw, self_conditioning_logits=bt.sc).logits[0].float().softmax(-1).max(-1)
            agree += int((arg[ref >= 0] == ref[ref >= 0]).sum())
            ridden += int((ref >= 0).sum())
            conf.append(p[st.train])
            wrong.append((arg != st.target)[st.train])
    c, w = torch.cat(conf), torch.cat(wrong)
    bars = {
        t: (float((c >= t).float().mean()), float((w & (c >= t)).sum() / max(1, int((c >= t).sum()))))
        for t in BARS
    }
    return {
        "adapter": adapter,
        "agree": agree / max(ridden, 1),
        "accuracy": float((~w).float().mean()),
        "bars": bars,
    }


def main(name: str, over: str, *adapters: str) -> None:
    torch.set_num_threads(1)
    bundle = load_bundle(None)
    states, runtime_arg = record(bundle, name, json.loads(over))
    print(f"{len(states)} states")
    for adapter in (None, "models/testbed/d2f_adapter", *adapters):
        print(json.dumps(replay(bundle, states, runtime_arg, adapter)))


if __name__ == "__main__":
    main(*sys.argv[1:])
