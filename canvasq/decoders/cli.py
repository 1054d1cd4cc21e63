"""`canvasq bench`: same-process decoder A/B. Imports only click at module top (instant --help)."""

from __future__ import annotations

import click


@click.command("bench")
@click.option(
    "--model",
    "model_spec",
    default=None,
    help="HF directory or random:testbed (default: $CANVASQ_MODEL / models/testbed).",
)
@click.option(
    "--arm", "arms", multiple=True, help="decoder[:key=value,...]; repeat (default: official, pipe, funnel)."
)
@click.option(
    "--task",
    "task_names",
    multiple=True,
    type=click.Choice(["arith", "code"]),
    help="Repeatable (default: both).",
)
@click.option("--n", default=20, show_default=True, help="Problems per task per seed.")
@click.option("--seeds", default="1", show_default=True, help="Comma-separated seeds.")
@click.option("--batch-size", default=8, show_default=True, help="Prompts per run_batch call.")
@click.option("--max-tokens", default=128, show_default=True)
@click.option("--baseline", default=None, help="Arm label the ratios refer to (default: the first arm).")
@click.option("--device", default="cpu", show_default=True)
@click.option("--threads", default=1, show_default=True, help="torch intra-op threads (CPU).")
@click.option("--out", "out_dir", default="bench-out", show_default=True, type=click.Path(file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="End with one JSON line (always printed last).")
def bench(
    model_spec,
    arms,
    task_names,
    n,
    seeds,
    batch_size,
    max_tokens,
    baseline,
    device,
    threads,
    out_dir,
    as_json,
):
    """A/B decoders in one process: accuracy, tok/s, forwards, tokens and rows per forward, G/τ.

    Seeds are reset per arm and the arm order is counterbalanced (ABBA) across (task, seed) blocks.
    Writes bench.md, bench.png and bench.json to --out; the last line printed is JSON.

    Example:

        canvasq bench --task arith --n 50 --seeds 1,2,3 --arm official --arm funnel:tau_conf=0.7
        canvasq bench --arm official --arm official:experts=w4 --device cuda
    """
    from pathlib import Path

    import torch

    from canvasq.decoders import bench as B
    from canvasq.model.loading import load_bundle

    torch.set_num_threads(threads)
    bundle = load_bundle(model_spec, device=device)
    arm_list = [B.parse_arm(a) for a in (arms or ("official", "pipe", "funnel"))]
    report = B.run_bench(
        bundle,
        arm_list,
        list(task_names or ("arith", "code")),
        n=n,
        seeds=[int(s) for s in seeds.split(",") if s.strip()],
        batch_size=batch_size,
        max_tokens=max_tokens,
        progress=lambda msg: click.echo(msg, err=True),
    )
    md, png = B.save(report, Path(out_dir), baseline)
    click.echo(md.read_text())
    click.echo(f"report: {md}  plot: {png}")
    click.echo(B.summary_json(report))
