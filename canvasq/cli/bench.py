"""`canvasq bench`: same-process decoder A/B. Imports only click at module top (instant --help)."""

from __future__ import annotations

import click


def _require_sandbox(tasks: list[str]) -> None:
    """Code tasks are verified by running model-written code: refuse with one line, before any
    generation, where the sandbox cannot be had."""
    if "code" in tasks:
        from canvasq.testbed.sandbox import unavailable_reason

        reason = unavailable_reason()
        if reason:
            raise click.ClickException(f"--task code needs the verifier's sandbox: {reason}")


@click.command("bench")
@click.option(
    "--model",
    "model_spec",
    default=None,
    help="HF directory or random:testbed (default: $CANVASQ_MODEL / models/testbed).",
)
@click.option(
    "--arm",
    "arms",
    multiple=True,
    help="decoder[:key=value,...] (official, pipe, funnel, phcd, auto); repeat (default: official, pipe, funnel).",
)
@click.option(
    "--task",
    "task_names",
    multiple=True,
    type=click.Choice(["arith", "code", "long"]),
    help="Repeatable (default: arith and code; long: arith's 6+ canvas variant, give it --max-tokens 384).",
)
@click.option("--n", default=20, show_default=True, help="Problems per task per seed.")
@click.option("--seeds", default="1", show_default=True, help="Comma-separated seeds (of --split).")
@click.option(
    "--split",
    type=click.Choice(["eval", "dev"]),
    default="eval",
    show_default=True,
    help="The testbed's problem split: eval to report, dev to tune on.",
)
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
    split,
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

    \b
        canvasq bench --task arith --n 50 --seeds 1,2,3 --arm official --arm funnel:tau_conf=0.7
        canvasq bench --arm official --arm official:experts=w4 --device cuda
        canvasq bench --n 200 --seeds 31,32,33 --batch-size 16 --arm official --arm auto   # after calibrate
    """
    from pathlib import Path

    tasks = list(task_names or ("arith", "code"))
    _require_sandbox(tasks)
    import torch

    from canvasq.decoders import bench as B
    from canvasq.model.loading import load_bundle
    from canvasq.testbed import tasks as testbed_tasks

    torch.set_num_threads(threads)
    arm_list = [B.parse_arm(a) for a in (arms or ("official", "pipe", "funnel"))]
    calibration, budget = _auto_calibration(model_spec, arm_list)
    bundle = load_bundle(model_spec, device=device)
    report = B.run_bench(
        bundle,
        arm_list,
        tasks,
        n=n,
        seeds=[int(s) for s in seeds.split(",") if s.strip()],
        batch_size=batch_size,
        max_tokens=max_tokens,
        progress=lambda msg: click.echo(msg, err=True),
        calibration=calibration,
        budget=budget,
        suite=testbed_tasks,
        split=split,
    )
    md, png = B.save(report, Path(out_dir), baseline)
    click.echo(md.read_text())
    click.echo(f"report: {md}  plot: {png}")
    click.echo(B.summary_json(report))


def _auto_calibration(model_spec, arms):
    """What an `auto` arm routes by: the model's stored calibration (None: official) and the budget."""
    if not any(a.decoder == "auto" for a in arms):
        return None, None
    from canvasq.cli.common import open_store
    from canvasq.core.calibrations import load_for_model
    from canvasq.core.settings import get_settings
    from canvasq.decoders.routing import routing_table

    settings = get_settings()
    store = open_store(settings)
    try:
        cal = load_for_model(store, model_spec or settings.model)
    finally:
        store.dispose()
    for task, decoder, source in routing_table(settings.routing, cal, settings.routing_budget):
        click.echo(f"auto: {task} -> {decoder}  [{source}]", err=True)
    return cal, settings.routing_budget


@click.command("calibrate")
@click.option(
    "--model",
    "model_spec",
    default=None,
    help="HF directory or random:testbed (default: $CANVASQ_MODEL / models/testbed).",
)
@click.option(
    "--task",
    "task_names",
    multiple=True,
    type=click.Choice(["arith", "code"]),
    help="Dev set per task family; repeatable (default: both).",
)
@click.option(
    "--n",
    default=100,
    show_default=True,
    help="Problems per task per seed (one problem is 100/n points: keep it finer than the routing budget).",
)
@click.option(
    "--seeds",
    default="101",
    show_default=True,
    help="Comma-separated seeds of the dev split (disjoint from eval whatever the seeds).",
)
@click.option(
    "--batch-size", default=16, show_default=True, help="Prompts per run_batch call (tok/s is at this batch)."
)
@click.option("--max-tokens", default=160, show_default=True)
@click.option(
    "--decoder",
    "decoders",
    multiple=True,
    type=click.Choice(["official", "pipe", "funnel"]),
    help="Sweep only these decoders' default settings (repeatable; official's reference always runs).",
)
@click.option(
    "--arm",
    "arms",
    multiple=True,
    help="Extra setting decoder[:key=value,...] (the bench syntax); repeatable.",
)
@click.option("--device", default="cpu", show_default=True)
@click.option("--threads", default=1, show_default=True, help="torch intra-op threads (CPU).")
@click.option("--show", is_flag=True, help="Print the stored frontier of the model and exit (no sweep).")
@click.option("--all", "show_all", is_flag=True, help="With --show: every point, not only the frontier.")
@click.option(
    "--plot",
    "plot_path",
    default=None,
    type=click.Path(dir_okay=False),
    help="Write a PNG: accuracy vs committed tok/s, one line per decoder.",
)
@click.option(
    "--budget",
    default=None,
    type=float,
    help="Accuracy points auto may give up (default: CANVASQ_ROUTING_BUDGET, 2).",
)
def calibrate(
    model_spec,
    task_names,
    n,
    seeds,
    batch_size,
    max_tokens,
    decoders,
    arms,
    device,
    threads,
    show,
    show_all,
    plot_path,
    budget,
):
    """Sweep each decoder's main knobs on a dev set per task family, store the frontier for this model.

    Measures accuracy, committed tok/s at --batch-size, forwards per request, τ (tokens per forward) and
    G/τ (rows per token) for every setting on the testbed tasks' dev split (never eval problems), and
    stores them in the database (CANVASQ_DATABASE_URL) keyed by the model's path and a fingerprint of
    its weights. `--decoder auto` then routes each task family to the fastest setting within
    CANVASQ_ROUTING_BUDGET points of the official sampler's accuracy; `canvasq config` shows the
    routing table.

    Example:

    \b
        canvasq calibrate                          # default sweep, n=100 per task, seed 101
        canvasq calibrate --n 100 --seeds 101,102 --arm funnel:tau_conf=0.95,draft_only=true
        canvasq calibrate --show --plot frontier.png
    """
    from canvasq.cli.common import open_store
    from canvasq.core import calibrations as stored
    from canvasq.core.settings import get_settings, settings_error_line

    try:
        settings = get_settings()
    except Exception as exc:  # noqa: BLE001 one line for a bad CANVASQ_* value
        raise click.ClickException(settings_error_line(exc)) from None
    spec = model_spec or settings.model
    budget = settings.routing_budget if budget is None else budget
    seed_list = _checked_sweep(spec, seeds, n, batch_size)
    store = open_store(settings)
    try:
        if show:
            _show_stored(store, spec, budget, show_all, plot_path)
            return
        tasks = list(task_names or ("arith", "code"))
        _require_sandbox(tasks)
        cal = _sweep(
            spec, _sweep_arms(decoders, arms), tasks, n, seed_list, batch_size, max_tokens, device, threads
        )
        cal_id = stored.save(store, cal)
        cal = stored.load(store, cal.model_path, cal.fingerprint)
        _print_calibration(cal, budget, False, plot_path)
        click.echo(f"stored calibration #{cal_id} for {cal.model_path}")
    finally:
        store.dispose()


def _show_stored(store, spec: str, budget: float, show_all: bool, plot_path: str | None) -> None:
    """`calibrate --show`: the stored frontier of `spec` (every point with --all), or one line why not."""
    from canvasq.core import calibrations as stored

    cal = stored.load_for_model(store, spec)
    if cal is None:
        raise click.ClickException(
            f"no calibration stored for {spec} in this database: run `canvasq calibrate`"
        )
    _print_calibration(cal, budget, not show_all, plot_path)


def _checked_sweep(spec: str, seeds: str, n: int, batch_size: int) -> list[int]:
    """The sweep's seeds, after its sizes and the model directory check out (one line each, before any load)."""
    try:
        seed_list = [int(s) for s in seeds.split(",") if s.strip()]
    except ValueError:
        raise click.ClickException(f"--seeds {seeds!r}: expected comma-separated integers") from None
    if not seed_list or n < 1 or batch_size < 1:
        raise click.ClickException("--n, --batch-size and --seeds must be positive / non-empty")
    if not spec.startswith("random:"):
        from canvasq.core.models import model_problem

        problem = model_problem(spec)
        if problem:
            raise click.ClickException(problem)
    return seed_list


def _sweep(spec, arm_list, tasks, n, seeds, batch_size, max_tokens, device, threads):
    """Load the model and run the sweep (`decoders.calibration.run_sweep`); returns its Calibration."""
    import torch

    from canvasq.decoders import calibration as cal_mod
    from canvasq.model.loading import load_bundle
    from canvasq.testbed import tasks as testbed_tasks

    torch.set_num_threads(threads)
    bundle = load_bundle(spec, device=device)
    cal, _ = cal_mod.run_sweep(
        bundle,
        arm_list,
        tasks,
        n=n,
        seeds=seeds,
        batch_size=batch_size,
        max_tokens=max_tokens,
        progress=lambda m: click.echo(m, err=True),
        suite=testbed_tasks,
    )
    return cal


def _sweep_arms(decoders: tuple[str, ...], arms: tuple[str, ...]) -> list:
    """The default sweep of `decoders` (all when none) plus each --arm, checked before any model loads."""
    from canvasq.decoders import calibration as cal_mod
    from canvasq.decoders.bench import parse_arm
    from canvasq.decoders.registry import make_config

    arm_list = cal_mod.default_arms(list(decoders) or None)
    for a in arms:
        arm = parse_arm(a)
        try:
            if arm.decoder not in ("official", "pipe", "funnel"):
                raise ValueError(f"decoder must be official, pipe or funnel, got {arm.decoder!r}")
            make_config(arm.decoder, arm.overrides)
        except ValueError as exc:
            raise click.ClickException(f"--arm {a}: {exc}") from None
        arm_list.append(arm)
    return arm_list


def _print_calibration(cal, budget: float, frontier_only: bool, plot_path: str | None) -> None:
    from pathlib import Path

    from canvasq.decoders import calibration as cal_mod

    click.echo(cal_mod.table(cal, budget, frontier_only=frontier_only))
    if plot_path:
        cal_mod.plot(cal, Path(plot_path))
        click.echo(f"plot: {plot_path}")
