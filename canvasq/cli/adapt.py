"""`canvasq adapt`: train a self-distilled, calibrated D2F adapter for a model directory
(canvasq/testbed/adapt.py does the work; torch is imported inside the command)."""

from __future__ import annotations

import json
from pathlib import Path

import click


@click.command("adapt")
@click.option(
    "--model", "model_spec", default=None, help="Model directory (default: $CANVASQ_MODEL or the testbed)."
)
@click.option(
    "--out",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="Directory for the new adapter (peft format), its report and log.",
)
@click.option(
    "--init",
    default="auto",
    show_default=True,
    help="Adapter to continue: a directory, 'auto' (the model's d2f_adapter/ when it has one) or 'none'.",
)
@click.option(
    "--task", "task_list", default="arith,code", show_default=True, help="Task families, comma-separated."
)
@click.option(
    "--teacher-n",
    type=int,
    default=256,
    show_default=True,
    help="Train-split problems per task the teacher decodes.",
)
@click.option("--rounds", type=int, default=3, show_default=True, help="Rollout → train rounds.")
@click.option(
    "--minutes", type=float, default=20.0, show_default=True, help="Training wall time over all rounds."
)
@click.option("--max-steps", type=int, default=None, help="Cap on optimiser steps per round (smoke runs).")
@click.option("--batch", type=int, default=32, show_default=True, help="States per optimiser step.")
@click.option("--lr", type=float, default=5e-4, show_default=True, help="Peak AdamW learning rate.")
@click.option(
    "--tau",
    type=float,
    default=0.7,
    show_default=True,
    help="Calibration bar: wrong argmax at p ≥ τ is punished.",
)
@click.option("--calibration-weight", type=float, default=1.0, show_default=True, help="Weight of that term.")
@click.option(
    "--target",
    type=click.Choice(["tokens", "logits", "mixed"]),
    default="tokens",
    show_default=True,
    help="What the front canvas learns: the teacher's answer tokens, its distribution on the same state, "
    "or per position the answer's token where the teacher gives it --answer-floor, else its distribution.",
)
@click.option(
    "--answer-floor",
    type=float,
    default=0.05,
    show_default=True,
    help="--target mixed: the teacher probability at which a front position keeps the answer's token.",
)
@click.option(
    "--decoder",
    type=click.Choice(["d2f", "official"]),
    default="d2f",
    show_default=True,
    help="d2f: the adapter pipe and Funnel decode with; official: certainty distillation for the native "
    "sampler on its own verified trajectories (decode with official:adapter_path=OUT).",
)
@click.option(
    "--certainty-weight",
    type=float,
    default=0.5,
    show_default=True,
    help="--decoder official: weight of the entropy term on positions whose argmax is already right.",
)
@click.option(
    "--noise-share", type=float, default=0.15, show_default=True, help="Share of fully noised front canvases."
)
@click.option(
    "--decode-batch", type=int, default=16, show_default=True, help="Prompts per teacher / rollout batch."
)
@click.option("--seed", type=int, default=35, show_default=True, help="Problem, sampling and batch seed.")
@click.option("--threads", type=int, default=None, help="torch CPU threads (default: torch's).")
@click.option("--force", is_flag=True, help="Write into --out even when it already holds an adapter.")
def adapt_cmd(model_spec, out, init, task_list, threads, force, **train):
    """Train a D2F adapter by self-distillation on pipe's and Funnel's own states.

    The teacher is the model with the adapter off: the official sampler answers train-split problems
    of the testbed's task families and the answers the task checker verifies are kept (no dev or eval
    problem is ever drawn). Each round, pipe and Funnel decode a share of those prompts with the current
    adapter and record their states (argmax drafts, frozen commits, the self-conditioning they feed);
    the adapter then trains on them: cross-entropy to the teacher's tokens on open positions plus a
    calibration term against a wrong argmax at p ≥ τ. The model's own d2f_adapter/ is never replaced;
    decoders take the new one with the knob adapter_path.

    Example:

    \b
        canvasq adapt --out adapters/self1 --teacher-n 256 --rounds 3 --minutes 20 --threads 2
        canvasq bench --split eval --task arith --n 200 --seeds 61 \\
          --arm 'pipe:front="revise",adapter_path="adapters/self1"'
    """
    from canvasq.model.loading import ADAPTER_DIRNAME, default_model_spec

    spec = model_spec or default_model_spec()
    tasks = tuple(t.strip() for t in task_list.split(",") if t.strip())
    _check_numbers(train)
    unknown = sorted(set(tasks) - {"arith", "code"})
    if unknown or not tasks:
        raise click.UsageError(f"--task takes arith and/or code, got {task_list!r}")
    _check_paths(spec, out, force, ADAPTER_DIRNAME)
    # the model's own D2F adapter is a pipe/Funnel denoiser: official's starts from the plain weights
    init_dir = _init_dir(
        "none" if init == "auto" and train["decoder"] == "official" else init, Path(spec) / ADAPTER_DIRNAME
    )
    if "code" in tasks:  # the checker runs model-written code: never unconfined
        from canvasq.testbed.sandbox import unavailable_reason

        reason = unavailable_reason()
        if reason:
            raise click.ClickException(reason)

    import torch

    from canvasq.model.loading import load_bundle
    from canvasq.testbed.adapt import AdaptSettings

    if threads:
        torch.set_num_threads(threads)
    bundle = load_bundle(spec, device="cuda" if torch.cuda.is_available() else "cpu")
    report = _train(bundle, AdaptSettings(out=out, init=init_dir, tasks=tasks, **train))
    last = report["rounds"][-1]
    arm = "official" if train["decoder"] == "official" else "funnel"
    click.echo(
        f"adapter written to {out} ({report['total_seconds']:.0f} s, {len(report['rounds'])} rounds, "
        f"last loss {last['final_loss']}); decode with it: --arm '{arm}:adapter_path=\"{out}\"'"
    )
    click.echo(json.dumps({"out": str(out), "total_seconds": report["total_seconds"]}))


def _check_numbers(train: dict) -> None:
    """The numeric options' ranges, as one-line usage errors naming the option."""
    for name in ("teacher_n", "rounds", "batch", "decode_batch"):
        if train[name] < 1:
            raise click.UsageError(f"--{name.replace('_', '-')} must be at least 1, got {train[name]}")
    if train["minutes"] <= 0 or not 0 < train["tau"] < 1 or not 0 <= train["noise_share"] <= 1:
        raise click.UsageError("--minutes must be > 0, --tau in (0, 1), --noise-share in [0, 1]")
    if train["certainty_weight"] < 0:
        raise click.UsageError(f"--certainty-weight must be at least 0, got {train['certainty_weight']}")
    if not 0 < train["answer_floor"] < 1:
        raise click.UsageError(f"--answer-floor must be in (0, 1), got {train['answer_floor']}")


def _check_paths(spec: str, out: Path, force: bool, own: str) -> None:
    """The model is a local directory and --out neither its own adapter nor (without --force) another."""
    if not Path(spec).is_dir():
        raise click.ClickException(
            f"model {spec!r} is not a directory (canvasq adapt trains a local checkpoint)"
        )
    if out.resolve() == (Path(spec) / own).resolve():
        raise click.ClickException(
            f"--out is the model's own {own}/: write elsewhere, compare, then copy it over"
        )
    if (out / "adapter_config.json").exists() and not force:
        raise click.ClickException(f"{out} already holds an adapter (--force to overwrite)")


def _train(bundle, settings) -> dict:
    """`testbed.adapt.adapt` (`testbed.certainty.distil` for --decoder official), its progress echoed and
    appended to OUT/adapt_log.txt."""
    from canvasq.testbed.adapt import adapt
    from canvasq.testbed.certainty import distil

    settings.out.mkdir(parents=True, exist_ok=True)
    with open(settings.out / "adapt_log.txt", "a") as logf:

        def log(line: str) -> None:
            click.echo(line)
            logf.write(line + "\n")
            logf.flush()

        return (distil if settings.decoder == "official" else adapt)(bundle, settings, log)


def _init_dir(init: str, own: Path) -> Path | None:
    """--init as a directory (None: a fresh LoRA)."""
    if init == "none":
        return None
    if init == "auto":
        return own if (own / "adapter_config.json").is_file() else None
    path = Path(init)
    if not (path / "adapter_config.json").is_file():
        raise click.ClickException(f"--init {init}: no peft adapter there (adapter_config.json)")
    return path
