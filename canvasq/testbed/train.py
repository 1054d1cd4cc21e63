"""Training recipe for the testbed DiffusionGemma (run on a GPU; also runs, slowly, on CPU).

Phase 1 — the base model, DiffusionGemma's uniform-state objective through HF's own forward:
a problem's answer is cut into canvases; one canvas per example is the target, the prompt and the
earlier (clean) canvases go through the encoder into the KV cache, and the target canvas is
corrupted by replacing each token with a uniform-random vocabulary id with probability t ~ U(0, 1).
The decoder predicts every position (cross-entropy). With probability ½ per example the decoder
also receives self-conditioning logits from a first, gradient-free pass on the same input.

Phase 2 — the D2F adapter, a LoRA (peft) on the attention and MLP projections trained on the
multi-canvas block-causal schedule the pipe decodes with: K consecutive canvases at increasing
noise in one decoder pass, each attending to the cache and to the earlier canvases' noisy tokens
(never later ones). Saved beside the model in `d2f_adapter/` and merged at load time.

Data: the train split, 5,000 problems per task from each stream seed `seed * 1_000_003 + i`
(`tasks.generate(..., split="train")`), so a training run never draws a dev or eval problem. The committed checkpoint was trained before
the splits, on the legacy unpartitioned streams of the same seeds (`ledger.LEGACY_TRAINING`); running
this now draws the partitioned train split instead, so it does not repeat that data.

Example (what produced the committed checkpoint, then on the legacy streams; see README "Testbed"):
    python -m canvasq.testbed.train --out models/testbed --minutes 7 --d2f-minutes 1.5 --seed 0
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from multiprocessing import Pool
from pathlib import Path

import numpy as np

from canvasq.model.shapes import TESTBED, build_config
from canvasq.testbed.config import BOS_ID, EOS_ID, PAD_ID, SEP_ID

TOKENIZER_DIR = Path(__file__).resolve().parents[2] / "models" / "testbed"


# ------------------------------------------------------------------------------------ data


def _encode_chunk(args):
    task, seed, n, tok_dir = args
    from transformers import AutoTokenizer

    from canvasq.testbed import tasks

    tok = AutoTokenizer.from_pretrained(tok_dir)
    probs = tasks.generate(task, n, seed, split="train")
    prompts = tok([p.prompt for p in probs], add_special_tokens=False)["input_ids"]
    answers = tok([p.answer for p in probs], add_special_tokens=False)["input_ids"]
    return [([BOS_ID, *p, SEP_ID], [*a, EOS_ID]) for p, a in zip(prompts, answers)]


def build_pool(n_per_task: int, seed: int, tok_dir: str, canvas: int, workers: int):
    """All problems (the train split) as one padded id matrix: row = prompt ‖ answer padded to whole
    canvases."""
    chunk = 5000
    jobs = [
        (task, seed * 1_000_003 + i, min(chunk, n_per_task - i * chunk), tok_dir)
        for task in ("arith", "code")
        for i in range(math.ceil(n_per_task / chunk))
    ]
    with Pool(workers) as pool:
        rows = [r for part in pool.map(_encode_chunk, jobs) for r in part]
    max_p = max(len(p) for p, _ in rows)
    max_c = max(math.ceil(len(a) / canvas) for _, a in rows)
    seq = np.full((len(rows), max_p + max_c * canvas), PAD_ID, dtype=np.int64)
    plen = np.zeros(len(rows), dtype=np.int64)
    ncan = np.zeros(len(rows), dtype=np.int64)
    for i, (p, a) in enumerate(rows):
        seq[i, : len(p)] = p
        seq[i, len(p) : len(p) + len(a)] = a
        plen[i], ncan[i] = len(p), math.ceil(len(a) / canvas)
    return seq, plen, ncan


# ------------------------------------------------------------------------------ batch maker


class Batches:
    """Vectorised batch assembly on the training device (no Python per example)."""

    def __init__(self, seq, plen, ncan, canvas: int, vocab: int, device):
        import torch

        self.torch = torch
        self.seq = torch.as_tensor(seq, device=device)
        self.plen = torch.as_tensor(plen, device=device)
        self.ncan = torch.as_tensor(ncan, device=device)
        self.C, self.V, self.device = canvas, vocab, device

    def sample(self, batch: int, n_canvases: int, gen, shift: bool = False):
        """Rows: (left-padded context, its mask, K target canvases, their noisy versions).

        The first target canvas index j is uniform over the answer; the context is the prompt
        plus canvases < j. With K > 1 the K canvases after it follow (pads past the answer's end
        are legitimate targets: the sampler writes pad after EOS). `shift`: the context also takes
        0..C-1 further answer tokens, so the canvases start anywhere (phcd's window starts at the
        committed prefix, not on a canvas boundary)."""
        torch, C = self.torch, self.C
        idx = torch.randint(0, self.seq.shape[0], (batch,), device=self.device, generator=gen)
        nc = self.ncan[idx]
        j = (torch.rand(batch, device=self.device, generator=gen) * nc).long()
        ctx_len = self.plen[idx] + j * C
        if shift:
            ctx_len = ctx_len + torch.randint(0, C, (batch,), device=self.device, generator=gen)
        L = int(ctx_len.max())
        t = torch.arange(L, device=self.device)
        src = t[None, :] - (L - ctx_len)[:, None]
        ctx_mask = src >= 0
        ctx = torch.where(ctx_mask, self.seq[idx[:, None], src.clamp(min=0)], PAD_ID)
        tgt_pos = ctx_len[:, None] + torch.arange(n_canvases * C, device=self.device)[None, :]
        in_range = tgt_pos < self.seq.shape[1]
        target = torch.where(
            in_range, self.seq[idx[:, None], tgt_pos.clamp(max=self.seq.shape[1] - 1)], PAD_ID
        )
        # Noise level per canvas: increasing along the K canvases (D2F schedule), uniform for K = 1.
        base = torch.rand(batch, 1, device=self.device, generator=gen)
        if n_canvases > 1:
            steps = torch.rand(batch, n_canvases, device=self.device, generator=gen).sort(dim=1).values
            level = (steps * (1 - base) + base * 0.3).clamp(max=1.0)
        else:
            level = base
        level = level.repeat_interleave(C, dim=1)
        corrupt = torch.rand(target.shape, device=self.device, generator=gen) < level
        noise = torch.randint(0, self.V, target.shape, device=self.device, generator=gen)
        noisy = torch.where(corrupt, noise, target)
        return ctx, ctx_mask, target, noisy


# --------------------------------------------------------------------------------- forward


def _cache_of(out):
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


def block_causal_masks(model, ctx_mask, n_canvases: int, canvas: int, cache):
    """4D boolean decoder masks for K canvases after a context of length L (True = may attend).

    Keys are [cached context entries] ‖ [K·C window rows]. Row r of canvas k sees context keys
    (not padding) and window rows of canvases ≤ k. On sliding layers the cache holds only the
    last W − 1 context entries and every key must also lie at position ≥ start(k) − (W − 1)."""
    import torch

    tc = model.config.text_config
    B, L = ctx_mask.shape
    KC = n_canvases * canvas
    rows = torch.arange(KC, device=ctx_mask.device)
    can_of_row = rows // canvas
    start = L + can_of_row * canvas  # absolute position of each row's canvas start
    win_ok = can_of_row[None, :] <= can_of_row[:, None]  # [KC, KC] block-causal
    masks = {}
    for kind in set(tc.layer_types):
        if kind == "sliding_attention":
            keep = min(L, tc.sliding_window - 1)
            ctx_pos = torch.arange(L - keep, L, device=ctx_mask.device)
            ctx_ok = ctx_mask[:, L - keep :]
            lo = start - (tc.sliding_window - 1)
            band_ctx = ctx_pos[None, :] >= lo[:, None]  # [KC, keep]
            win_pos = L + rows
            band_win = win_pos[None, :] >= lo[:, None]
            m_ctx = ctx_ok[:, None, :] & band_ctx[None]
            m_win = (win_ok & band_win)[None].expand(B, -1, -1)
        else:
            m_ctx = ctx_mask[:, None, :].expand(B, KC, L)
            m_win = win_ok[None].expand(B, -1, -1)
        masks[kind] = torch.cat([m_ctx, m_win], dim=-1)[:, None]
    return masks


def encode_context(model, ctx, ctx_mask):
    """The context (left-padded prompt ‖ earlier canvases) through the encoder once; its KV cache is what
    every decoder pass of the step attends to."""
    import torch
    from transformers import DynamicCache

    B, L = ctx.shape
    tc = model.config.text_config
    pos = torch.arange(L, device=ctx.device)[None].expand(B, -1)
    enc = model.model.encoder(
        input_ids=ctx,
        attention_mask=ctx_mask.long(),
        position_ids=pos,
        past_key_values=DynamicCache(config=tc),
    )
    return _cache_of(enc)


def denoise_loss(
    model,
    batch,
    n_canvases: int,
    canvas: int,
    sc_prob: float,
    gen,
    token_weight=None,
    draft_rounds: int = 0,
    commit_tau: tuple[float, float] | None = None,
):
    """Cross-entropy of the decoder's prediction of the clean canvases (optionally with SC).

    `draft_rounds` > 0 (the D2F adapter): the step draws r in 0..draft_rounds and first runs r
    gradient-free passes, each replacing the corrupted positions with the previous pass's argmax and
    feeding its raw logits back as SC — the state the pipe / funnel decoders are in after r steps of
    argmax renoise. The trained pass then sees the model's own drafts instead of uniform noise.

    `commit_tau` (lo, hi) makes those passes on-policy for the step decoders' final commits: a bar
    τ ~ U(lo, hi) is drawn, each pass commits the open positions whose confidence clears it (frozen,
    right or wrong, as the pipe commits them), and the loss covers only the positions still open —
    the ones whose confidence the next commit decision reads."""
    import torch

    ctx, ctx_mask, target, noisy = batch
    B = ctx.shape[0]
    cache = encode_context(model, ctx, ctx_mask)
    kw = _decoder_kwargs(model, ctx_mask, noisy, cache, n_canvases, canvas)
    sc_logits, sc_mask = None, None
    rounds = 0
    if draft_rounds:
        rounds = int(torch.randint(0, draft_rounds + 1, (1,), device=ctx.device, generator=gen))
    open_ = None
    if rounds:
        sc_logits, open_ = _draft_passes(model, kw, noisy, target, rounds, commit_tau, gen)
        sc_mask = torch.rand(B, device=ctx.device, generator=gen) < max(sc_prob, 0.9)
    elif sc_prob > 0:
        sc_logits, sc_mask = _self_conditioning(model, kw, B, sc_prob, gen)
    logits = model(**kw, self_conditioning_logits=sc_logits, self_conditioning_mask=sc_mask).logits
    ce = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1), reduction="none"
    )
    w = token_weight[target.reshape(-1)] if token_weight is not None else torch.ones_like(ce)
    if open_ is not None and bool(open_.any()):
        w = w * open_.reshape(-1)
    return (ce * w).sum() / w.sum()


def _decoder_kwargs(model, ctx_mask, noisy, cache, n_canvases: int, canvas: int) -> dict:
    """The decoder's inputs after the cached context: positions continue the context's, and K > 1
    canvases see each other block-causally (one canvas needs only the context's padding mask)."""
    import torch

    B, L = ctx_mask.shape
    dpos = torch.arange(L, L + n_canvases * canvas, device=ctx_mask.device)[None].expand(B, -1)
    if n_canvases == 1:
        dmask = torch.nn.functional.pad(ctx_mask, (0, canvas), value=True).long()
    else:
        dmask = block_causal_masks(model, ctx_mask, n_canvases, canvas, cache)
    return {
        "past_key_values": cache,
        "decoder_input_ids": noisy,
        "decoder_attention_mask": dmask,
        "decoder_position_ids": dpos,
    }


def _draft_passes(model, kw: dict, noisy, target, rounds: int, commit_tau, gen):
    """`rounds` gradient-free argmax-draft passes (denoise_loss's docstring); `kw["decoder_input_ids"]`
    ends as the last drafts. Returns (the last pass's logits as SC, the positions still open or None
    without `commit_tau`)."""
    import torch

    corrupt = noisy != target
    open_ = None
    if commit_tau is not None:
        lo, hi = commit_tau
        tau = lo
        if hi > lo:
            tau = lo + (hi - lo) * float(torch.rand(1, device=noisy.device, generator=gen))
        open_ = corrupt.clone()
    sc_logits = None
    with torch.no_grad():
        for _ in range(rounds):
            first = model(**kw, self_conditioning_logits=sc_logits).logits
            if open_ is None:
                kw["decoder_input_ids"] = torch.where(corrupt, first.argmax(-1), target)
            else:  # committed positions keep the id they were committed with
                conf, arg = torch.softmax(first.float(), dim=-1).max(dim=-1)
                kw["decoder_input_ids"] = torch.where(open_, arg, kw["decoder_input_ids"])
                open_ &= conf < tau
            sc_logits = first.to(model.dtype)  # the decoders feed raw logits back
    return sc_logits, open_


def _self_conditioning(model, kw: dict, B: int, sc_prob: float, gen):
    """(SC logits, per-row mask) from a gradient-free pass on the same input, for a `sc_prob` share of
    the rows."""
    import torch

    with torch.no_grad():
        first = model(**kw).logits
    # The official sampler feeds temperature-scaled logits (t from 0.8 down to 0.4) back as SC.
    temp = 0.4 + 0.4 * torch.rand(B, 1, 1, device=first.device, generator=gen)
    sc_logits = (first / temp).to(model.dtype)
    sc_mask = torch.rand(B, device=first.device, generator=gen) < sc_prob
    return sc_logits, sc_mask


# ---------------------------------------------------------------------------------- phases


def train_phase(
    model,
    params,
    batches,
    *,
    minutes,
    batch,
    lr,
    n_canvases,
    canvas,
    sc_prob,
    gen,
    log,
    tag,
    token_weight=None,
    draft_rounds=0,
    commit_tau=None,
    loss_fn=None,
):
    """AdamW with warm-up and cosine decay for `minutes` of wall time. `loss_fn(model, batch_size, gen)`
    replaces the sample + `denoise_loss` step (canvasq/testbed/repair.py's objectives)."""
    import torch

    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
    t0, step, warm = time.time(), 0, 100
    budget = minutes * 60
    ema = None
    device_type = "cuda" if str(batches.device).startswith("cuda") else "cpu"
    while True:
        frac = (time.time() - t0) / budget
        if frac >= 1:
            break
        scale = min(1.0, (step + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))
        for g in opt.param_groups:
            g["lr"] = lr * scale
        b = batches.sample(batch, n_canvases, gen) if loss_fn is None else None
        try:
            with torch.autocast(device_type, dtype=torch.bfloat16, enabled=device_type == "cuda"):
                if loss_fn is not None:
                    loss = loss_fn(model, batch, gen)
                else:
                    loss = denoise_loss(
                        model, b, n_canvases, canvas, sc_prob, gen, token_weight, draft_rounds, commit_tau
                    )
        except (RuntimeError, NotImplementedError) as exc:  # grouped_mm unsupported for this dtype
            if step > 0 or not hasattr(model, "set_experts_implementation"):
                raise
            log(f"[{tag}] grouped experts failed ({exc}); falling back to eager experts")
            model.set_experts_implementation("eager")
            continue
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        if step % 100 == 0 or (step < 100 and step % 10 == 0):
            log(f"[{tag}] step {step} loss {ema:.4f} lr {lr * scale:.2e} {time.time() - t0:.0f}s")
    log(f"[{tag}] done: {step} steps in {time.time() - t0:.0f}s, loss {ema:.4f}")
    return {"steps": step, "seconds": round(time.time() - t0, 1), "final_loss": round(float(ema), 4)}


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--minutes", type=float, default=7.0)
    ap.add_argument("--d2f-minutes", type=float, default=1.5)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--n-per-task", type=int, default=300_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 2))
    ap.add_argument("--init", default=None, help="continue from this checkpoint directory")
    ap.add_argument("--d2f-canvases", type=int, default=2)
    ap.add_argument("--digit-weight", type=float, default=4.0)
    ap.add_argument("--d2f-init", default=None, help="continue training this D2F adapter directory")
    ap.add_argument(
        "--d2f-commit-tau",
        default=None,
        help="LO,HI: draft passes commit (and freeze) positions at a bar drawn in [LO, HI]; loss on open ones",
    )
    ap.add_argument(
        "--d2f-draft-rounds",
        type=int,
        default=2,
        help="D2F adapter: up to this many gradient-free argmax-draft passes before the trained one (0: uniform noise only)",
    )
    return ap


def main(argv=None):
    args = _parser().parse_args(argv)

    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(args.seed)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = _run_log(out / "train_log.txt")
    shape = TESTBED
    t0 = time.time()
    seq, plen, ncan = build_pool(
        args.n_per_task, args.seed, str(TOKENIZER_DIR), shape.canvas_length, args.workers
    )
    log(f"data: {seq.shape[0]} problems, max row {seq.shape[1]} tokens, built in {time.time() - t0:.0f}s")
    batches = Batches(seq, plen, ncan, shape.canvas_length, shape.vocab_size, device)

    model = _base_model(args.init, shape, device)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: {n_params / 1e6:.2f} M parameters on {device}")
    report = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "params": n_params}
    from transformers import AutoTokenizer

    token_weight = digit_weights(
        AutoTokenizer.from_pretrained(str(TOKENIZER_DIR)), shape.vocab_size, args.digit_weight, device
    )
    if args.minutes > 0:
        report["base"] = train_phase(
            model,
            [p for p in model.parameters() if p.requires_grad],
            batches,
            minutes=args.minutes,
            batch=args.batch,
            lr=args.lr,
            n_canvases=1,
            canvas=shape.canvas_length,
            sc_prob=0.5,
            gen=gen,
            log=log,
            tag="base",
            token_weight=token_weight,
        )
    model.eval()
    if args.minutes > 0:  # --minutes 0 --init DIR: train only the adapter against DIR's base
        save_model(model, out)

    if args.d2f_minutes > 0:
        report["d2f"] = _train_adapter(model, batches, args, shape, gen, log, token_weight, out)
    report["total_seconds"] = round(time.time() - t0, 1)
    (out / "train_report.json").write_text(json.dumps(report, indent=2))
    log(json.dumps(report))


def _run_log(path: Path):
    """A log function printing each line and appending it to `path`, flushed as it goes so a killed run
    keeps its log."""
    logf = open(path, "a")  # noqa: SIM115 - the run's log, open for the whole run

    def log(msg):
        print(msg, flush=True)
        logf.write(msg + "\n")
        logf.flush()

    return log


def _base_model(init: str | None, shape, device):
    """The model to train, in train mode: continued from `init`'s checkpoint, else freshly initialised
    from the global seed."""
    import torch
    from transformers import DiffusionGemmaForBlockDiffusion

    if init:
        model = DiffusionGemmaForBlockDiffusion.from_pretrained(init, dtype=torch.float32).to(device)
    else:
        model = DiffusionGemmaForBlockDiffusion(build_config(shape)).to(device)
    model.train()
    return model


def digit_weights(tok, vocab: int, weight: float, device):
    """Per-token CE weights: `weight` on the digits 0-9, 1 elsewhere. Digits carry the arithmetic: they
    are a few percent of answer tokens but all of its difficulty."""
    import torch

    token_weight = torch.ones(vocab, device=device)
    token_weight[[tok.convert_tokens_to_ids(str(d)) for d in range(10)]] = weight
    return token_weight


def _train_adapter(model, batches, args, shape, gen, log, token_weight, out: Path) -> dict:
    """The D2F LoRA on the decoder's modules, trained on multi-canvas batches; saved to out/d2f_adapter."""
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(
        r=16,
        lora_alpha=32,
        lora_dropout=0.0,
        # Decoder modules only: encoder and decoder share weight tensors, so merging the LoRA
        # into the decoder's weights updates the encoder too (adding it to both would double it).
        target_modules=r".*decoder\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)",
    )
    if args.d2f_init:  # continue an adapter (same rank and targets)
        from peft import PeftModel

        peft_model = PeftModel.from_pretrained(model, args.d2f_init, is_trainable=True)
    else:
        peft_model = get_peft_model(model, lora)
    peft_model.train()
    report = train_phase(
        peft_model.base_model.model,
        [p for p in peft_model.parameters() if p.requires_grad],
        batches,
        minutes=args.d2f_minutes,
        batch=max(64, args.batch // 2),
        lr=args.lr / 2,
        n_canvases=args.d2f_canvases,
        canvas=shape.canvas_length,
        sc_prob=0.5,
        gen=gen,
        log=log,
        tag="d2f",
        token_weight=token_weight,
        draft_rounds=args.d2f_draft_rounds,
        commit_tau=_pair(args.d2f_commit_tau),
    )
    peft_model.save_pretrained(str(out / "d2f_adapter"))
    return report


def _pair(text: str | None) -> tuple[float, float] | None:
    """'LO,HI' -> (LO, HI); None stays None."""
    if not text:
        return None
    lo, hi = (float(v) for v in text.split(","))
    return lo, hi


def save_model(model, out: Path):
    """bf16 safetensors in shards small enough to bring back from the GPU machine."""
    import copy

    import torch

    from canvasq.testbed.config import EOS_ID as eos

    m = copy.deepcopy(model).to("cpu", torch.bfloat16)
    gc = m.generation_config
    gc.eos_token_id, gc.pad_token_id, gc.bos_token_id = eos, PAD_ID, BOS_ID
    m.save_pretrained(str(out), max_shard_size="12MB")


if __name__ == "__main__":
    main()
