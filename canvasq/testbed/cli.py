"""Click commands for the testbed (imports only click at module level; torch inside)."""

from __future__ import annotations

import json

import click


@click.command("eval")
@click.option(
    "--task",
    type=click.Choice(["arith", "code", "long"]),
    required=True,
    help="Task family (long: arith's variant whose answers span 6+ canvases).",
)
@click.option("--n", "n", type=int, default=200, show_default=True, help="Fresh problems to draw.")
@click.option("--seed", type=int, default=1, show_default=True, help="Problem and sampling seed.")
@click.option(
    "--decoder", default="official", show_default=True, help="official, pipe, funnel, phcd or auto."
)
@click.option(
    "--model", "model_spec", default=None, help="Model directory (default: $CANVASQ_MODEL or the testbed)."
)
@click.option(
    "--batch", "batch_size", type=int, default=16, show_default=True, help="Prompts decoded together."
)
@click.option(
    "--entropy-bound",
    type=float,
    default=None,
    help="Official sampler's entropy bound (default: checkpoint's).",
)
@click.option("--json", "as_json", is_flag=True, help="End with one JSON line.")
def eval_cmd(task, n, seed, decoder, model_spec, batch_size, entropy_bound, as_json):
    """Accuracy, tokens, forwards and tok/s of a decoder on fresh testbed problems.

    Problems come from the eval split: disjoint from the train and dev splits and from the committed
    checkpoint's training data, whatever the seed.

    `forwards` counts every model pass: decoder denoising steps and encoder commit passes.

    Example:

    \b
        canvasq eval --task arith --n 200 --seed 1 --decoder official --json
        canvasq eval --task long --n 50 --seed 1 --decoder phcd
    """
    if task == "code":  # checked before any generation: model-written code never runs unconfined
        from canvasq.testbed.sandbox import unavailable_reason

        reason = unavailable_reason()
        if reason:
            raise click.ClickException(reason)
    import torch

    from canvasq.model.loading import load_bundle
    from canvasq.testbed.eval import evaluate

    device = "cuda" if torch.cuda.is_available() else "cpu"
    bundle = load_bundle(model_spec, device=device)
    if entropy_bound is not None and decoder != "official":
        raise click.UsageError("--entropy-bound applies to the official decoder only")
    overrides = {"entropy_bound": float(entropy_bound)} if entropy_bound is not None else None
    report = evaluate(bundle, task, n, seed, decoder=decoder, batch_size=batch_size, overrides=overrides)
    d = report.as_dict()
    click.echo(
        f"{task} · {decoder} · n={n} seed={seed}: accuracy {d['accuracy']:.3f}, "
        f"{d['mean_tokens']:.1f} tokens/answer, {d['forwards']} forwards, "
        f"{d['tok_per_forward']:.2f} tok/forward, {d['tok_per_s']:.1f} tok/s ({device})"
    )
    if as_json:
        click.echo(json.dumps(d))


@click.group("testbed")
def testbed():
    """The tiny trained DiffusionGemma: training recipe and tokenizer.

    Example:

    \b
        canvasq testbed train --out models/testbed --minutes 6 --d2f-minutes 1
    """


@testbed.command("train", context_settings={"ignore_unknown_options": True})
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def train(args):
    """Train the testbed model (base uniform-state objective, then the D2F LoRA).

    All options are those of `python -m canvasq.testbed.train --help`.

    Example:

    \b
        canvasq testbed train --out /tmp/tb --init models/testbed --minutes 6 --d2f-minutes 0.8
    """
    from canvasq.testbed.train import main

    main(list(args))


@testbed.command("tokenizer")
@click.option("--out", required=True, type=click.Path(), help="Directory for the HF tokenizer files.")
@click.option("--vocab-size", type=int, default=768, show_default=True)
@click.option("--n-per-task", type=int, default=20000, show_default=True)
def tokenizer_cmd(out, vocab_size, n_per_task):
    """Train the byte-level BPE tokenizer on the task corpus.

    Example:

    \b
        canvasq testbed tokenizer --out models/testbed
    """
    from pathlib import Path

    from canvasq.testbed.tokenizer import train_tokenizer

    tok = train_tokenizer(Path(out), vocab_size, n_per_task)
    click.echo(f"tokenizer with {len(tok)} tokens written to {out}")
