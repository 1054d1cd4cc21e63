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
from pathlib import Path

from canvasq.model.shapes import TESTBED, build_config
from canvasq.testbed.config import BOS_ID, PAD_ID
from canvasq.testbed.train_data import Batches, build_pool
from canvasq.testbed.train_loss import denoise_loss, digit_weights

TOKENIZER_DIR = Path(__file__).resolve().parents[2] / "models" / "testbed"


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
