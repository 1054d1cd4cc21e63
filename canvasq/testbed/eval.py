"""Accuracy of a decoder on fresh testbed problems: `canvasq eval --task arith --n 200 --seed 1`.

Reports accuracy, mean generated tokens, forwards (every model pass: decoder denoising steps and
encoder commit passes), tokens per forward and wall tok/s; `--json` ends with one JSON line.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

from canvasq.testbed import tasks


@dataclass
class EvalReport:
    task: str
    decoder: str
    n: int
    seed: int
    accuracy: float
    tokens: int
    mean_tokens: float
    forwards: int
    tok_per_forward: float
    seconds: float
    tok_per_s: float

    def as_dict(self) -> dict:
        return asdict(self)


def official_generate(model, prompts: list[list[int]], max_new_tokens: int, pad_id: int, **gen_kwargs):
    """HF `generate()` unchanged over several prompts (left-padded). Returns the new ids per row
    and the forwards spent (decoder steps + encoder passes)."""
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    device = next(model.parameters()).device
    counter = {"decode": 0, "encode": 0}

    def count(kind):
        def hook(*_):
            counter[kind] += 1

        return hook

    handles = [
        model.model.decoder.register_forward_hook(count("decode")),
        model.model.encoder.register_forward_hook(count("encode")),
    ]
    try:
        out = model.generate(
            ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_new_tokens, **gen_kwargs
        )
    finally:
        for h in handles:
            h.remove()
    seqs = out.sequences if hasattr(out, "sequences") else out
    return [row[width:].tolist() for row in seqs.cpu()], counter["decode"] + counter["encode"]


def evaluate(bundle, task: str, n: int, seed: int, decoder: str = "official", batch_size: int = 16,
             max_tokens: int | None = None, overrides: dict | None = None,
             gen_kwargs: dict | None = None) -> EvalReport:
    import torch

    problems = tasks.generate(task, n, seed)
    max_tokens = max_tokens or 5 * bundle.canvas_length
    correct = tokens = forwards = 0
    t0 = time.perf_counter()
    for start in range(0, n, batch_size):
        chunk = problems[start : start + batch_size]
        prompts = [bundle.encode_prompt(p.prompt, p.task) for p in chunk]
        torch.manual_seed(seed * 100_003 + start)
        if decoder == "official" and not overrides:
            outs, f = official_generate(bundle.hf_model, prompts, max_tokens, bundle.pad_id, **(gen_kwargs or {}))
            texts = [bundle.decode_text(o) for o in outs]
            n_tok = [_answer_len(o, bundle.eos_id, bundle.pad_id) for o in outs]
        else:
            from canvasq.decoders import run_batch
            from canvasq.decoders.types import DecodeBatch, DecodeRequest

            reqs = [DecodeRequest(p.uid, ids, max_tokens, p.task) for p, ids in zip(chunk, prompts)]
            results = run_batch(bundle, DecodeBatch(reqs, seed=seed * 100_003 + start), decoder, overrides)
            texts = [r.text for r in results]
            n_tok = [len(r.token_ids) for r in results]
            f = max(r.forwards for r in results)
        forwards += f
        tokens += sum(n_tok)
        correct += sum(tasks.verify(p, t) for p, t in zip(chunk, texts))
    secs = time.perf_counter() - t0
    return EvalReport(
        task=task, decoder=decoder, n=n, seed=seed, accuracy=correct / n, tokens=tokens,
        mean_tokens=tokens / n, forwards=forwards, tok_per_forward=tokens / max(forwards, 1),
        seconds=round(secs, 2), tok_per_s=tokens / secs,
    )


def _answer_len(ids: list[int], eos: int, pad: int) -> int:
    """Generated tokens up to and including EOS (what the user receives, plus the stop token)."""
    n = 0
    for i in ids:
        if i == pad:
            break
        n += 1
        if i == eos:
            break
    return n


def main(argv=None):
    """`python -m canvasq.testbed.eval MODEL --n 128 --batch 64 [--bounds 0.1,1,4]`: the official
    sampler's accuracy per task, optionally swept over its entropy bound (GPU-friendly batches)."""
    import argparse
    import json

    import torch

    from canvasq.model.loading import load_bundle

    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--n", type=int, default=128)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--bounds", default="")
    args = ap.parse_args(argv)
    bundle = load_bundle(args.model, device="cuda" if torch.cuda.is_available() else "cpu")
    for task in tasks.TASKS:
        print(json.dumps(evaluate(bundle, task, args.n, args.seed, batch_size=args.batch).as_dict()), flush=True)
    if args.bounds:
        from transformers.models.diffusion_gemma.generation_diffusion_gemma import EntropyBoundSamplerConfig

        for bound in (float(b) for b in args.bounds.split(",")):
            for task in tasks.TASKS:
                cfg = {"sampler_config": EntropyBoundSamplerConfig(entropy_bound=bound)}
                r = evaluate(bundle, task, args.n, args.seed, batch_size=args.batch, gen_kwargs=cfg)
                print(json.dumps({"entropy_bound": bound, **r.as_dict()}), flush=True)


if __name__ == "__main__":
    main()
