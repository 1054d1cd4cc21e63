"""The `phcd` repair adapter (issue 24 part 2): a LoRA trained on what `phcd` feeds the model.

On top of the testbed base with its D2F adapter merged (what `phcd` decodes with), a second peft
LoRA on the same decoder modules is trained for `--minutes` of wall time on batches laid out as a
`phcd` forward: one bidirectional window of C rows whose start is *anywhere* in the answer (the
committed prefix p is not on a canvas boundary: the context is prompt + answer[:p]), followed by
`--future` block-causal canvases (the global canvas; D2F layout). Three cross-entropy objectives
toward the true continuation, on specially corrupted inputs, drawn per example:

- **local refinement** (window, half the examples): the window at uniform noise t ~ U(0, 1), every
  row self-conditioned: refine the local window given the committed prefix.
- **commit consistency** (window, the other half): the window as it is after the controller slid it
  by k tokens: its front rows were refined for longer (noise ~ U(0, 0.3)), its back is fresh
  (U(0.5, 1)), rising linearly; the front rows weigh up to 2x. The controller commits the leading
  rows whose argmax is stable and confident, so those must be right under any shift.
- **future repair** (the future canvases, weight `--future-weight`): the future carries stale drafts:
  the argmax of a gradient-free pass made before the window was known (all-noise window, future at
  noise U(0.5, 1)), for half the examples misaligned by ±1-2 positions (a plan that assumed a
  different commit), with their self-conditioning; the target is the true continuation after the
  committed prefix.

Self-conditioning as `phcd` gives it: the window's from a gradient-free pass on the same input, the
future's from the draft pass. The loop is `train.train_phase` (AdamW, warm-up, cosine) with this loss.
Saved to `<out>/phcd_adapter/` (peft) with `<out>/train_report_phcd_repair.json`; `phcd:adapter=repair`
merges it over the D2F model (`ModelBundle.phcd_repair_model`).

What produced the committed adapter (v2; v1 was the same with --decoder-only and --minutes 18):
    python -m canvasq.testbed.repair --out models/testbed --minutes 11 --batch 16 --future 1 --n-per-task 10000 --seed 5
Its data came from the legacy unpartitioned streams (`ledger.LEGACY_TRAINING`); `train_data.build_pool` now
draws the train split (`tasks.generate(..., split="train")`), so re-running this trains on other
problems than the committed adapter saw, and never on dev or eval ones.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

REPAIR_DIRNAME = "phcd_adapter"
LORA_TARGETS = r".*decoder\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)"


class _Draws:
    """A step's random draws, all from its generator, so a seed replays the step."""

    def __init__(self, gen, device, vocab: int):
        self.gen, self.device, self.vocab = gen, device, vocab

    def rand(self, *shape):
        import torch

        return torch.rand(*shape, device=self.device, generator=self.gen)

    def noise(self, shape):
        """Uniform-random vocabulary ids: the uniform-state corruption."""
        import torch

        return torch.randint(0, self.vocab, shape, device=self.device, generator=self.gen)


def repair_loss(
    model, batches, batch: int, gen, *, n_future: int, token_weight, future_weight: float, parts: dict
):
    """One step's loss over the three objectives (module docstring); `parts` accumulates their CE."""
    import torch

    from canvasq.testbed.train_loss import block_causal_masks, cache_kwargs, encode_context

    C, V = batches.C, batches.V
    K = 1 + n_future
    ctx, ctx_mask, target, _ = batches.sample(batch, K, gen, shift=True)
    B, L = ctx.shape
    dev = ctx.device
    draws = _Draws(gen, dev, V)
    cache = encode_context(model, ctx, ctx_mask)
    dpos = torch.arange(L, L + K * C, device=dev)[None].expand(B, -1)
    dmask = block_causal_masks(model, ctx_mask, K, C, cache)

    def run(ids, sc=None, sc_mask=None):
        return model(
            **cache_kwargs(model, cache),
            decoder_input_ids=ids,
            decoder_attention_mask=dmask,
            decoder_position_ids=dpos,
            self_conditioning_logits=sc,
            self_conditioning_mask=sc_mask,
        ).logits

    win_t, fut_t = target[:, :C], target[:, C:]
    commit_mode, frac, win_in = _window_input(draws, win_t)
    inp, sc = _stale_plan_input(run, draws, win_in, fut_t, n_future, model.dtype)
    sc_mask = draws.rand(B) < 0.9
    logits = run(inp, sc, sc_mask)
    ce = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1), reduction="none"
    ).view(B, K * C)
    tw = token_weight[target] if token_weight is not None else torch.ones_like(ce)
    row_w = torch.ones(B, K * C, device=dev)
    row_w[:, :C] = torch.where(commit_mode, 2.0 - frac, 1.0)
    row_w[:, C:] = future_weight
    w = tw * row_w
    loss = (ce * w).sum() / w.sum()
    _track_parts(parts, ce, commit_mode, C)
    return loss


def _window_input(draws: _Draws, win_t):
    """The window's corrupted input: (a) local refinement at uniform noise, or (b) a slid window, front
    refined, back fresh. Returns (commit_mode [B, 1], row fraction [1, C], the window's ids [B, C])."""
    import torch

    B, C = win_t.shape
    commit_mode = draws.rand(B, 1) < 0.5
    frac = torch.arange(C, device=win_t.device)[None].float() / max(1, C - 1)
    front, back = 0.3 * draws.rand(B, 1), 0.5 + 0.5 * draws.rand(B, 1)
    level = torch.where(commit_mode, front + (back - front) * frac, draws.rand(B, 1).expand(B, C))
    win_in = torch.where(draws.rand(B, C) < level, draws.noise((B, C)), win_t)
    return commit_mode, frac, win_in


def _stale_plan_input(run, draws: _Draws, win_in, fut_t, n_future: int, dtype):
    """(c) The trained pass's input and self-conditioning, gradient-free: the future holds a stale plan
    drafted before the window was known, then (half the rows) misaligned by ±1-2."""
    import torch

    B, C = win_in.shape
    dev = win_in.device
    with torch.no_grad():
        fut_level = 0.5 + 0.5 * draws.rand(B, 1)
        fut_noisy = torch.where(draws.rand(fut_t.shape) < fut_level, draws.noise(fut_t.shape), fut_t)
        first = run(torch.cat([draws.noise((B, C)), fut_noisy], dim=1))
        drafts, draft_sc = first[:, C:].argmax(-1), first[:, C:]
        offs = torch.tensor([-2, -1, 1, 2], device=dev)[
            torch.randint(0, 4, (B,), device=dev, generator=draws.gen)
        ]
        offs = torch.where(draws.rand(B) < 0.5, offs, 0)
        src = (torch.arange(n_future * C, device=dev)[None] + offs[:, None]).clamp(0, n_future * C - 1)
        drafts = drafts.gather(1, src)
        draft_sc = draft_sc.gather(1, src[..., None].expand(-1, -1, draft_sc.shape[-1]))
        inp = torch.cat([win_in, drafts], dim=1)
        # the window's self-conditioning: the previous fine step on (nearly) the same input
        sc = torch.cat([run(inp)[:, :C], draft_sc], dim=1).to(dtype)
    return inp, sc


def _track_parts(parts: dict, ce, commit_mode, C: int) -> None:
    """Fold this step's per-objective CE into `parts`' moving averages (for the log, not the loss)."""
    import torch

    with torch.no_grad():
        win_ce = ce[:, :C].mean(1)
        for name, val in (
            ("local", win_ce[~commit_mode[:, 0]]),
            ("commit", win_ce[commit_mode[:, 0]]),
            ("future", ce[:, C:].mean(1)),
        ):
            if val.numel():
                prev = parts.get(name)
                parts[name] = float(val.mean()) if prev is None else 0.95 * prev + 0.05 * float(val.mean())


def tie_encoder(model) -> list:
    """Route the encoder's projections through the decoder's LoRA-wrapped modules. Encoder and decoder
    share these weight tensors, so the merged adapter changes the encoder too (the prompt's K/V):
    training with the LoRA on the decoder alone leaves the encoder unseen. Returns what `untie_encoder`
    puts back before saving (the adapter is saved under the decoder's module names only)."""
    saved = []
    for el, dl in zip(model.model.encoder.language_model.layers, model.model.decoder.layers):
        for part, names in (
            ("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
            ("mlp", ("gate_proj", "up_proj", "down_proj")),
        ):
            ep, dp = getattr(el, part), getattr(dl, part)
            for n in names:
                saved.append((ep, n, getattr(ep, n)))
                setattr(ep, n, getattr(dp, n))
    return saved


def untie_encoder(saved: list) -> None:
    for parent, name, module in saved:
        setattr(parent, name, module)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--out", required=True, help="the testbed directory (base + d2f_adapter/); the adapter goes here"
    )
    ap.add_argument("--minutes", type=float, default=15.0)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument(
        "--future", type=int, default=3, help="future canvases behind the window (phcd: windows - 1)"
    )
    ap.add_argument("--future-weight", type=float, default=0.5)
    ap.add_argument("--digit-weight", type=float, default=4.0)
    ap.add_argument("--n-per-task", type=int, default=20_000)
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--decoder-only",
        action="store_true",
        help="train with the LoRA on the decoder's forward only (v1; the merged weights still change the encoder)",
    )
    return ap


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)

    import torch

    from canvasq.model.loading import load_bundle
    from canvasq.testbed.train_data import Batches, build_pool
    from canvasq.testbed.train_loss import digit_weights

    torch.set_num_threads(args.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(args.seed)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    out = Path(args.out)
    log = _repair_log(out / "train_log_phcd_repair.txt")
    t0 = time.time()
    bundle = load_bundle(str(out), device="cpu")
    C, V = bundle.canvas_length, int(bundle.config.text_config.vocab_size)
    seq, plen, ncan = build_pool(args.n_per_task, args.seed, str(out), C, workers=1)
    log(f"data: {seq.shape[0]} problems, max row {seq.shape[1]} tokens, built in {time.time() - t0:.0f}s")
    batches = Batches(seq, plen, ncan, C, V, device)
    peft_model, tied, params = _repair_lora(bundle, out, args, device)
    log(f"repair LoRA r={args.rank}: {sum(p.numel() for p in params)} trainable parameters on {device}")
    token_weight = digit_weights(bundle.tokenizer, V, args.digit_weight, device)
    report, parts = _train_repair(peft_model, params, batches, token_weight, C, gen, log, args)
    untie_encoder(tied)
    peft_model.save_pretrained(str(out / REPAIR_DIRNAME))
    (out / REPAIR_DIRNAME / "README.md").unlink(missing_ok=True)  # peft's empty model card
    report = _repair_report(args, argv, device, report, parts, t0)
    (out / "train_report_phcd_repair.json").write_text(json.dumps(report, indent=2))
    log(json.dumps(report))


def _train_repair(
    peft_model, params, batches, token_weight, canvas: int, gen, log, args
) -> tuple[dict, dict]:
    """Train the repair LoRA for --minutes on `repair_loss`; the phase report and the last loss parts."""
    from canvasq.testbed.train import train_phase

    parts: dict = {}

    def loss_fn(m, batch, g):
        return repair_loss(
            m,
            batches,
            batch,
            g,
            n_future=args.future,
            token_weight=token_weight,
            future_weight=args.future_weight,
            parts=parts,
        )

    def log_parts(msg):
        log(msg + ("  [" + " ".join(f"{k} {v:.4f}" for k, v in parts.items()) + "]" if parts else ""))

    report = train_phase(
        peft_model.base_model.model,
        params,
        batches,
        minutes=args.minutes,
        batch=args.batch,
        lr=args.lr,
        n_canvases=1 + args.future,
        canvas=canvas,
        sc_prob=0.9,
        gen=gen,
        log=log_parts,
        tag="phcd-repair",
        loss_fn=loss_fn,
    )
    return report, parts


def _repair_log(path: Path):
    """A log function printing each line and appending it to `path` (reopened per line: a killed run
    keeps every line it logged)."""

    def log(msg):
        print(msg, flush=True)
        with open(path, "a") as f:
            f.write(msg + "\n")

    return log


def _repair_lora(bundle, out: Path, args, device):
    """The repair LoRA over the D2F-merged model (what phcd decodes with), in train mode, with the encoder
    tied to it unless --decoder-only. Returns (peft model, what `untie_encoder` puts back, trainable
    parameters)."""
    from peft import LoraConfig, get_peft_model

    from canvasq.model.loading import ADAPTER_DIRNAME, merge_adapter

    model = merge_adapter(bundle.hf_model, out / ADAPTER_DIRNAME).to(device)  # what phcd decodes with
    lora = LoraConfig(r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.0, target_modules=LORA_TARGETS)
    peft_model = get_peft_model(model, lora)
    peft_model.train()
    inner = peft_model.base_model.model
    tied = [] if args.decoder_only else tie_encoder(inner)
    params = [p for p in peft_model.parameters() if p.requires_grad]
    return peft_model, tied, params


def _repair_report(args, argv, device: str, phase: dict, parts: dict, t0: float) -> dict:
    """train_report_phcd_repair.json: the machine, the objectives, the phase's report, the final CE per
    objective and the command that reproduces the run."""
    import torch

    return {
        "device": torch.cuda.get_device_name()
        if device == "cuda"
        else f"cpu ({os.cpu_count()} vCPU, shared)",
        "torch": torch.__version__,
        "threads": args.threads,
        "machine": platform.machine(),
        "objectives": ["local refinement", "commit consistency", "future repair"],
        "lora_in_encoder_forward": not args.decoder_only,
        "repair": phase,
        "final_ce": {k: round(v, 4) for k, v in parts.items()},
        "cpu_minutes": round(phase["seconds"] / 60, 2),
        "args": vars(args),
        "command": "python -m canvasq.testbed.repair " + " ".join(sys.argv[1:] if argv is None else argv),
        "total_seconds": round(time.time() - t0, 1),
    }


if __name__ == "__main__":
    main()
