"""Commands that read runs: `status`, `runs`, `results`, `trace`, `workers`."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import click

from canvasq.cli.common import (
    MISSING_SHOWN,
    RUN_STATUS_CHOICES,
    AtomicOutput,
    cli_settings,
    fmt_s,
    fmt_tok_s,
    get_run,
    json_option,
    open_store,
    report_unfinished,
    status_line,
    table,
)
from canvasq.cli.embedded import reap_interrupted
from canvasq.core.results import write_results
from canvasq.core.settings import model_name


@click.command()
@click.argument("run_id", metavar="RUN")
@click.option("--watch", is_flag=True, help="Redraw until the run ends (Ctrl-C to stop watching).")
@click.option("--interval", type=float, default=2.0, show_default=True, help="Seconds between redraws.")
@json_option
def status(run_id, watch, interval, as_json):
    """Progress of RUN: counts per status, tokens, tok/s, ETA (all counted from rows).

    Example:

    \b
        canvasq status run_1a2b3c4d --watch
    """
    settings = cli_settings()
    store = open_store(settings, upgrade_sqlite=False)
    run_row = get_run(store, run_id)
    reap_interrupted(store, settings)
    while True:
        s = store.run_summary(run_row.id)
        if as_json:
            click.echo(json.dumps(s, default=str))
        else:
            click.echo(status_line(s))
        if not watch or s["status"] not in ("queued", "running", "cancelling"):
            if s["status"] == "interrupted":
                click.echo(
                    f"{s['run_id']} was interrupted: the same `canvasq run` command continues it", err=True
                )
            break
        time.sleep(interval)


@click.command()
@click.option(
    "--status",
    "status_",
    type=click.Choice(RUN_STATUS_CHOICES),
    default=None,
    help="Only runs in this state.",
)
@click.option("--limit", type=int, default=20, show_default=True)
@json_option
def runs(status_, limit, as_json):
    """List recent runs with their request counts.

    Example:

    \b
        canvasq runs --status running --limit 5
    """
    settings = cli_settings()
    store = open_store(settings, upgrade_sqlite=False)
    reap_interrupted(store, settings)
    rows = store.list_runs(status_, limit)
    if as_json:
        click.echo(json.dumps(rows))
        return
    click.echo(
        table(
            [
                "run",
                "name",
                "status",
                "total",
                "done",
                "errored",
                "expired",
                "cancelled",
                "queued",
                "decoder",
                "created",
            ],
            [
                [
                    r["run_id"],
                    r["name"],
                    r["status"],
                    r["total"],
                    r["done"],
                    r["errored"],
                    r["expired"],
                    r["cancelled"],
                    r["queued"],
                    r["decoder"],
                    r["created_at"],
                ]
                for r in rows
            ],
        )
    )


@click.command()
@click.argument("run_id", metavar="RUN")
@click.option(
    "-o",
    "--output",
    "out_path",
    type=click.Path(dir_okay=False),
    default="-",
    show_default=True,
    help="Where to write OpenAI batch output lines.",
)
@click.option(
    "--errors",
    "errors_path",
    type=click.Path(dir_okay=False),
    default=None,
    help="Write errored / expired / cancelled rows here instead of into OUTPUT.",
)
@click.option("--ordered", is_flag=True, help="In input-file order (default: completion order).")
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Report counts and unfinished rows as one JSON line (on stderr when OUTPUT is stdout).",
)
def results(run_id, out_path, errors_path, ordered, as_json):
    """Export RUN's finished rows as OpenAI batch output lines.

    On a run that is not finished, only its finished rows are exported, and it says so: how many rows
    are missing and the first of their custom_ids.

    Example:

    \b
        canvasq results run_1a2b3c4d -o out.jsonl --errors err.jsonl --ordered
    """
    settings = cli_settings()
    store = open_store(settings, upgrade_sqlite=False)
    run_row = get_run(store, run_id)
    reap_interrupted(store, settings)
    if (
        errors_path is not None
        and out_path != "-"
        and os.path.realpath(errors_path) == os.path.realpath(out_path)
    ):
        raise click.BadParameter("is the same file as --output", param_hint="--errors")
    n_ok, n_err = _export_results(store, run_row, out_path, errors_path, ordered)
    if as_json:
        c = store.counts(run_row.id)
        click.echo(
            json.dumps(
                {
                    "run_id": run_row.id,
                    "status": store.run_status(run_row.id),
                    "results": n_ok,
                    "errors": n_err,
                    "unfinished": c["queued"],
                    "total": c["total"],
                    "missing": store.missing_rows(run_row.id, MISSING_SHOWN),
                }
            ),
            err=out_path == "-",
        )
        return
    click.echo(f"{n_ok} results, {n_err} errors", err=True)
    report_unfinished(store, run_row.id)


def _export_results(store, run_row, out_path, errors_path, ordered: bool) -> tuple[int, int]:
    """Write the run's rows to OUTPUT and --errors; (results, errors) written. Files appear whole or
    not at all; devices and pipes are written as the rows come."""
    files, direct = [], []  # files: temporary files renamed into place when complete; direct: devices, pipes

    def open_target(path):
        if path is None:
            return None
        if path == "-":
            return sys.stdout
        if Path(path).exists() and not Path(path).is_file():  # /dev/stdout, a FIFO: written as it goes
            direct.append(open(path, "w", encoding="utf-8"))  # noqa: SIM115 - closed below
            return direct[-1]
        files.append(AtomicOutput(path))
        return files[-1].fh

    try:
        out, err = open_target(out_path), open_target(errors_path)
        n_ok, n_err = write_results(store, run_row, out, err, ordered=ordered)
        for f in files:
            f.commit()
    except BaseException:
        for f in files:
            f.discard()
        raise
    finally:
        for fh in direct:
            fh.close()
    return n_ok, n_err


@click.command()
@click.argument("run_id", metavar="RUN")
@click.argument("custom_id")
@click.option(
    "--plot",
    "plot_path",
    type=click.Path(dir_okay=False),
    default=None,
    help="Write a PNG: window rows (G) and commits (τ) per forward.",
)
@json_option
def trace(run_id, custom_id, plot_path, as_json):
    """Per-forward trace of one request: rows in the window, commits, canvases live, ms.

    Example:

    \b
        canvasq trace run_1a2b3c4d q17 --plot q17.png
    """
    store = open_store(cli_settings(), upgrade_sqlite=False)
    run_row = get_run(store, run_id)
    rows = store.traces(run_row.id, custom_id)
    if not rows:
        raise click.ClickException(
            f"no trace for {custom_id!r} in {run_row.id}: {_why_no_trace(store, run_row.id, custom_id)}"
        )
    recs = [
        {
            "forward": t.forward_index,
            "kind": t.kind,
            "rows": t.rows,
            "commits": t.commits,
            "own_rows": t.own_rows,
            "own_commits": t.own_commits,
            "canvases": t.canvases,
            "states": t.states,
            "ms": round(t.ms, 3),
        }
        for t in rows
    ]
    if as_json:
        click.echo(json.dumps(recs))
    else:
        click.echo(
            table(
                ["forward", "kind", "rows", "commits", "own rows", "own commits", "canvases", "states", "ms"],
                [list(r.values()) for r in recs],
            )
        )
        click.echo(
            f"{len(recs)} forwards, {sum(r['commits'] for r in recs)} commits, "
            f"{sum(r['rows'] for r in recs)} window rows, {sum(r['ms'] for r in recs):.1f} ms"
        )
    if plot_path:
        state = store.row_state(run_row.id, custom_id)
        decoder = state[1].decoder if state and state[1] is not None else None
        plot_trace(
            recs,
            plot_path,
            title=f"{run_row.id} / {custom_id}  (decoder {decoder or '?'}, "
            f"{len(recs)} forwards, {sum(r['ms'] for r in recs):.0f} ms)",
        )
        click.echo(f"wrote {plot_path}", err=True)


def _why_no_trace(store, run_id: str, custom_id: str) -> str:
    """Why a row has no forwards stored: it does not exist, is not finished, or ended without a forward."""
    state = store.row_state(run_id, custom_id)
    if state is None:
        return "the run has no row with that custom_id"
    status, out = state
    if status == "queued":
        return "the row is not finished (queued); its trace is stored when it finishes"
    if out is not None and out.error_code:
        return (
            f"the row ended {status} ({out.error_code}: {(out.error_message or '')[:120]}) before any forward "
            "was stored"
        )
    if out is not None and not out.forwards:
        return f"the row is {status} but ran no forward"
    return f"the row is {status} but its decoder ({out.decoder if out else '?'}) stored no per-forward trace"


def plot_trace(recs: list[dict], path: str, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    x = [r["forward"] for r in recs]
    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(10, 8), sharex=True)
    colors = ["tab:blue" if r["kind"] == "decode" else "tab:gray" for r in recs]
    ax1.bar(x, [r["rows"] for r in recs], color=colors, label="window rows G (gray: encoder pass)")
    if any(r["own_rows"] is not None for r in recs):
        ax1.step(
            x,
            [r["own_rows"] or 0 for r in recs],
            where="mid",
            color="tab:orange",
            label="this request's rows",
        )
    ax1.set_ylabel("rows in window")
    ax1.legend(loc="upper right")
    ax2.bar(x, [r["commits"] for r in recs], color="tab:green", label="commits τ (batch)")
    if any(r["own_commits"] is not None for r in recs):
        ax2.step(
            x,
            [r["own_commits"] or 0 for r in recs],
            where="mid",
            color="tab:orange",
            label="this request's commits",
        )
    ax2.set_ylabel("commits")
    ax2.legend(loc="upper right")
    ax3.bar(x, [r["ms"] for r in recs], color=colors)
    ax3.set_ylabel("ms per forward")
    ax3.set_xlabel("forward index")
    for ax in (ax1, ax2, ax3):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    for ax in (ax1, ax2):
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    fig.suptitle(title or "per-forward trace")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


@click.command()
@json_option
def workers(as_json):
    """Registered workers: online or offline, the chunk each holds, last heartbeat, throughput (from
    output rows). A worker is offline when its last heartbeat is older than 3 × CANVASQ_HEARTBEAT_S
    + 10 s (55 s by default): it died, or lost the store. Online workers come first.

    Example:

    \b
        canvasq workers
    """
    settings = cli_settings()
    store = open_store(settings, upgrade_sqlite=False)
    rows = store.worker_stats(settings.offline_after_s)
    rows.sort(key=lambda r: (not r["online"], r["last_seen_s"] if not r["online"] else 0, r["worker"]))
    if as_json:
        click.echo(json.dumps(rows))
        return
    click.echo(
        table(
            ["worker", "state", "chunk", "device", "model", "last seen", "requests", "tokens", "tok/s"],
            [
                [
                    r["worker"],
                    "online" if r["online"] else "offline",
                    r["chunk"] or "-",
                    r["device"],
                    model_name(r["model"]),
                    f"{fmt_s(r['last_seen_s'])} ago",
                    r["requests"],
                    r["tokens"],
                    fmt_tok_s(r["tok_s"]),
                ]
                for r in rows
            ],
        )
    )
