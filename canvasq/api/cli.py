"""`canvasq`: one click group for submitting, running, watching and exporting generation runs.

Heavy imports (torch, transformers, the decoders) happen only inside the commands that generate
(`run`, `worker`'s child, `retry` of an embedded run); `canvasq --help` imports click, pydantic and
nothing else heavy. Settings come from `CANVASQ_*` variables (see `canvasq.api.settings`).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
import uuid
from pathlib import Path

import click

from canvasq.api.settings import DECODERS, get_settings, mask_url, model_name

RUN_STATUS_CHOICES = ("queued", "running", "completed", "cancelling", "cancelled", "expired")


# ---------------------------------------------------------------------------------------- shared


def decoder_option(f):
    return click.option(
        "--decoder", type=click.Choice(DECODERS), default="auto", show_default=True,
        help="Decoding algorithm; auto routes math → funnel, code → pipe (CANVASQ_ROUTING overrides).",
    )(f)


def model_option(f):
    return click.option(
        "--model", "model", default=None, metavar="PATH|random:26b-a4b",
        help="Model spec (default: $CANVASQ_MODEL, else the repo's models/testbed).",
    )(f)


def json_option(f):
    return click.option("--json", "as_json", is_flag=True, help="Print one JSON line instead of a table.")(f)


def _settings(model: str | None = None):
    s = get_settings()
    return s.model_copy(update={"model": model}) if model else s


def _open_store(settings, *, upgrade_sqlite: bool = True):
    """The store; a SQLite database is created / upgraded on first use, a server database must be
    upgraded explicitly (`canvasq db upgrade`, the compose file's one-shot migration)."""
    from canvasq.api.store import SchemaOutOfDate, Store

    store = Store.from_settings(settings)
    try:
        store.check_schema()
    except SchemaOutOfDate as exc:
        if store.dialect != "sqlite" or not upgrade_sqlite:
            raise click.ClickException(str(exc)) from None
        store.upgrade()
    return store


def _get_run(store, run_id: str):
    run = store.get_run(run_id)
    if run is None:
        raise click.ClickException(f"no run {run_id!r} in {mask_url(store.url)}")
    return run


def _validate(path: str, settings):
    from canvasq.api.schemas import Limits, validate_file

    limits = Limits.for_model(settings)
    report = validate_file(path, limits)
    if not report.ok:
        click.echo(report.summary(), err=True)
        raise SystemExit(2)
    return limits, report


def _fmt_s(x: float | None) -> str:
    if x is None:
        return "-"
    x = int(x)
    return f"{x // 3600}:{x % 3600 // 60:02d}:{x % 60:02d}" if x >= 3600 else f"{x // 60}:{x % 60:02d}"


def _table(headers: list[str], rows: list[list]) -> str:
    cells = [[str(h) for h in headers]] + [["-" if c is None else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _tok_s(x) -> str | None:
    return f"{x:,.1f}" if x else None


def _per_req(forwards: int, requests: int) -> str | None:
    return f"{forwards / requests:.1f}" if requests else None


def _summary_table(summary: dict) -> str:
    """fwd/req: model passes that served a request, averaged over requests (a pass shared by a batch
    counts for each request it served, as in `canvasq bench`); tok/fwd: tokens per such pass."""
    rows = [[d["decoder"], d["requests"], d["tokens"], _per_req(d["forwards"], d["requests"]),
             f"{d['tokens'] / d['forwards']:.2f}" if d["forwards"] else None, f"{d['gen_s']:.1f}", _tok_s(d["tok_s"])]
            for d in summary["decoders"]]
    c = summary["counts"]
    done = sum(d["requests"] for d in summary["decoders"])
    gen_s = sum(d["gen_s"] for d in summary["decoders"])
    rows.append(["total", done, summary["completion_tokens"], _per_req(summary["forwards"], done),
                 f"{summary['completion_tokens'] / summary['forwards']:.2f}" if summary["forwards"] else None,
                 f"{gen_s:.1f}", _tok_s(summary["completion_tokens"] / gen_s if gen_s else None)])
    head = (f"run {summary['run_id']}  status {summary['status']}  model {model_name(summary['model'])}  "
            f"requests {c['total']} (done {c['done']}, errored {c['errored']}, expired {c['expired']}, "
            f"cancelled {c['cancelled']}, queued {c['queued']})  wall {_fmt_s(summary['wall_s'])}")
    return head + "\n" + _table(["decoder", "requests", "tokens", "fwd/req", "tok/fwd", "gen s", "tok/s"], rows)


def write_results(store, run, out, errors_out=None, ordered: bool = False) -> tuple[int, int]:
    """Write OpenAI batch output lines; errored/expired/cancelled rows go to `errors_out` when given."""
    from canvasq.api.schemas import output_line

    n_ok = n_err = 0
    name = model_name(run.model)
    for row in store.iter_results(run.id, ordered=ordered):
        o = row["output"]
        rid = uuid.uuid5(uuid.NAMESPACE_URL, f"canvasq:{run.id}:{row['custom_id']}").hex
        if row["status"] == "done" and o is not None and o.error_code is None:
            line = output_line(custom_id=row["custom_id"], model=name, text=o.text, finish_reason=o.finish_reason,
                               prompt_tokens=o.prompt_tokens, completion_tokens=o.completion_tokens,
                               request_id=rid, created=o.updated_at.timestamp(),
                               extra_usage={"forwards": o.forwards, "decoder": o.decoder})
            target, n_ok = out, n_ok + 1
        else:
            code = (o.error_code if o is not None and o.error_code else row["status"])
            msg = (o.error_message if o is not None and o.error_message else f"request {row['status']}")
            line = output_line(custom_id=row["custom_id"], model=name, error_code=code, error_message=msg,
                               request_id=rid)
            target, n_err = (errors_out or out), n_err + 1
        target.write(json.dumps(line, ensure_ascii=False) + "\n")
    return n_ok, n_err


def _process_embedded(store, settings, run_id: str, chunk_ids: list[str], total: int):
    from canvasq.worker.runtime import ChunkRuntime

    rt = ChunkRuntime(settings=settings, store=store, worker_id=f"embedded:{os.getpid()}", queue="embedded")
    rt.register()
    click.echo(f"loading {settings.model} ...", err=True)
    rt.bundle  # noqa: B018 - load before the progress bar starts
    with click.progressbar(length=total, label="generating", file=sys.stderr, show_eta=True,
                           show_percent=True, show_pos=True) as bar:
        queued = store.counts(run_id)["queued"]
        for cid in chunk_ids:  # one count per chunk: after one chunk is before the next
            rt.process_chunk(cid)
            now = store.counts(run_id)["queued"]
            bar.update(queued - now)
            queued = now
    store.finalize_run(run_id)


# ---------------------------------------------------------------------------------------- the group


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(package_name="canvasq")
def cli():
    """canvasq: batch generation with DiffusionGemma on a fleet of workers fed through Redis.

    Settings come from the environment: CANVASQ_DATABASE_URL (default SQLite ./canvasq.sqlite),
    CANVASQ_BROKER_URL (default redis://localhost:6379/0), CANVASQ_MODEL (default models/testbed).

    Example:

        canvasq run examples/prompts.jsonl -o results.jsonl
    """


@cli.command()
@click.argument("file", type=click.Path(exists=True, dir_okay=False))
@click.option("-o", "--output", "out_path", type=click.Path(dir_okay=False), default=None,
              help="Results JSONL (default: <FILE stem>.results.jsonl in the current directory).")
@decoder_option
@model_option
@click.option("--name", default=None, help="A name for the run.")
@click.option("--chunk-size", type=int, default=None, help="Requests per chunk (default: CANVASQ_DECODE_BATCH_SIZE).")
@json_option
def run(file, out_path, decoder, model, name, chunk_size, as_json):
    """Generate FILE in this process (embedded mode: SQLite store, no broker, no worker).

    Validates every line first (nothing runs on any error), decodes in chunks with a progress bar,
    writes OpenAI batch output lines and prints requests, tokens, forwards per request and tok/s per decoder.

    Example:

        canvasq run examples/prompts.jsonl -o results.jsonl --decoder auto
    """
    from canvasq.api.schemas import iter_jobs
    from canvasq.api.store import file_sha256

    settings = _settings(model)
    limits, _ = _validate(file, settings)
    store = _open_store(settings)
    created = store.create_run(
        iter_jobs(file, limits), model=settings.model, queue="embedded", decoder=decoder,
        chunk_size=chunk_size or settings.decode_batch_size, name=name or Path(file).name,
        input_path=str(Path(file).resolve()), input_sha256=file_sha256(file), mode="embedded",
    )
    click.echo(f"run {created.run_id}: {created.requests} requests, {len(created.chunk_ids)} chunks "
               f"(store {mask_url(store.url)})", err=True)
    t0 = time.perf_counter()
    _process_embedded(store, settings, created.run_id, created.chunk_ids, created.requests)
    wall = time.perf_counter() - t0
    out_path = out_path or f"{Path(file).stem}.results.jsonl"
    run_row = _get_run(store, created.run_id)
    with open(out_path, "w", encoding="utf-8") as fh:
        n_ok, n_err = write_results(store, run_row, fh, ordered=True)
    summary = store.run_summary(created.run_id)
    summary["process_wall_s"] = wall
    if as_json:
        click.echo(json.dumps(summary, default=str))
    else:
        click.echo(_summary_table(summary))
        click.echo(f"wrote {n_ok} results and {n_err} errors to {out_path} in {wall:.1f}s")


@cli.command()
@click.argument("file", type=click.Path(exists=True, dir_okay=False))
@click.option("--name", default=None, help="A name for the run.")
@decoder_option
@model_option
@click.option("--queue", default=None, help="Queue to publish to (default: canvasq.<model name>).")
@click.option("--key", "idempotency_key", default=None,
              help="Idempotency key: submitting the same key again returns the same run, publishes nothing. "
                   "Default: a hash of the file's bytes, the model, decoder, queue, chunk size and deadline.")
@click.option("--chunk-size", type=int, default=None, help="Requests per chunk (default: CANVASQ_CHUNK_SIZE).")
@click.option("--deadline", type=int, default=None, help="Seconds until unfinished rows expire.")
def submit(file, name, decoder, model, queue, idempotency_key, chunk_size, deadline):
    """Validate FILE, store the run, publish its chunks to the model's queue; print the run id.

    Rows are committed before any message is published; `canvasq reconcile` publishes what a crash
    in between left behind. Nothing is stored or published when any line is invalid.

    Example:

        RUN=$(canvasq submit prompts.jsonl --name nightly --decoder auto)
        canvasq status $RUN --watch
    """
    from canvasq.api.schemas import iter_jobs
    from canvasq.api.store import file_sha256
    from canvasq.worker.celery_app import publish_chunks

    settings = _settings(model)
    limits, _ = _validate(file, settings)
    store = _open_store(settings)
    queue = queue or settings.queue_for()
    chunk_size = chunk_size or settings.chunk_size
    deadline = deadline or settings.run_deadline_s
    digest = file_sha256(file)
    if idempotency_key is None:  # the same file with the same parameters is the same run
        params = json.dumps([digest, settings.model, decoder, queue, chunk_size, deadline])
        idempotency_key = "auto:" + hashlib.sha256(params.encode()).hexdigest()[:32]
    created = store.create_run(
        iter_jobs(file, limits), model=settings.model, queue=queue, decoder=decoder,
        chunk_size=chunk_size, name=name or Path(file).name,
        idempotency_key=idempotency_key, input_path=str(Path(file).resolve()), input_sha256=digest,
        deadline_s=deadline,
    )
    if created.created:
        publish_chunks(created.chunk_ids, queue, settings)
        store.mark_published(created.chunk_ids)
        click.echo(f"submitted {created.requests} requests in {len(created.chunk_ids)} chunks to {queue}", err=True)
    else:
        click.echo(f"key {idempotency_key!r} already submitted; nothing published", err=True)
    click.echo(created.run_id)


@cli.command()
@model_option
@click.option("--queue", default=None, help="Queue to consume (default: canvasq.<model name>).")
@click.option("--concurrency", type=int, default=1, show_default=True,
              help="Child processes; keep 1 per GPU (start one worker per CUDA_VISIBLE_DEVICES).")
@click.option("--loglevel", default="INFO", show_default=True)
@click.option("--pool", type=click.Choice(["prefork", "solo"]), default="prefork", show_default=True,
              help="prefork loads the model in a child (CUDA never touches the parent).")
@click.option("--gpu", default=None, metavar="N|auto",
              help="Set CUDA_VISIBLE_DEVICES=N, or claim a free slot of CANVASQ_GPU_SLOTS in Redis (auto).")
def worker(model, queue, concurrency, loglevel, pool, gpu):
    """Start a Celery worker process for one model (one per GPU).

    Refuses to start unless visibility_timeout > hard_time_limit > soft_time_limit. The model is
    loaded once in the child; the worker registers itself (host, device, model) and heartbeats.

    Example:

        CUDA_VISIBLE_DEVICES=0 canvasq worker --model /models/diffusiongemma &
        CUDA_VISIBLE_DEVICES=1 canvasq worker --model /models/diffusiongemma &
        CANVASQ_GPU_SLOTS=8 canvasq worker --gpu auto    # containers that see all GPUs
    """
    from canvasq.api.settings import reload_settings

    if model:
        os.environ["CANVASQ_MODEL"] = model
    settings = reload_settings()
    try:
        settings.check_time_limits()
    except ValueError as exc:
        raise click.ClickException(f"refusing to start: {exc}") from None
    queue = queue or settings.queue_for()
    os.environ["CANVASQ_WORKER_QUEUE"] = queue
    slot = None
    if gpu == "auto":
        import socket

        from canvasq.worker.gpu_slots import NoFreeSlot, claim_slot

        if not settings.gpu_slots:
            raise click.ClickException("--gpu auto needs CANVASQ_GPU_SLOTS (GPUs on this host)")
        try:
            slot = claim_slot(settings.broker_url, settings.gpu_host or socket.gethostname(), settings.gpu_slots)
        except NoFreeSlot as exc:
            raise click.ClickException(str(exc)) from None
        slot.start_refresher()
        os.environ["CUDA_VISIBLE_DEVICES"] = str(slot.slot)
    elif gpu is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = gpu
    store = _open_store(settings, upgrade_sqlite=False)
    store.dispose()
    from canvasq.worker.celery_app import app

    click.echo(f"worker for {settings.model} on queue {queue}; broker {mask_url(settings.broker_url)}; "
               f"store {mask_url(settings.database_url)}", err=True)
    try:
        app.worker_main([
            "worker", "-Q", queue, "-c", str(concurrency), "-P", pool, "-l", loglevel,
            "-n", f"canvasq-{os.getpid()}@%h", "--without-gossip", "--without-mingle",
        ])
    finally:
        if slot is not None:
            slot.release()


@cli.command()
@click.argument("run_id", metavar="RUN")
@click.option("--watch", is_flag=True, help="Redraw until the run ends (Ctrl-C to stop watching).")
@click.option("--interval", type=float, default=2.0, show_default=True, help="Seconds between redraws.")
@json_option
def status(run_id, watch, interval, as_json):
    """Progress of RUN: counts per status, tokens, tok/s, ETA (all counted from rows).

    Example:

        canvasq status run_1a2b3c4d --watch
    """
    store = _open_store(_settings(), upgrade_sqlite=False)
    run_row = _get_run(store, run_id)
    while True:
        s = store.run_summary(run_row.id)
        c = s["counts"]
        if as_json:
            click.echo(json.dumps(s, default=str))
        else:
            finished = c["total"] - c["queued"]
            width = 30
            fill = int(width * finished / c["total"]) if c["total"] else width
            bar = "#" * fill + "-" * (width - fill)
            click.echo(
                f"{s['run_id']} [{bar}] {finished}/{c['total']} {s['status']}  done {c['done']} errored "
                f"{c['errored']} expired {c['expired']} cancelled {c['cancelled']} queued {c['queued']}  "
                f"tokens {s['completion_tokens']}  tok/s {_tok_s(s['tok_s']) or '-'}  ETA {_fmt_s(s['eta_s'])}"
            )
        if not watch or s["status"] not in ("queued", "running", "cancelling"):
            break
        time.sleep(interval)


@cli.command()
@click.option("--status", "status_", type=click.Choice(RUN_STATUS_CHOICES), default=None, help="Only runs in this state.")
@click.option("--limit", type=int, default=20, show_default=True)
@json_option
def runs(status_, limit, as_json):
    """List recent runs with their request counts.

    Example:

        canvasq runs --status running --limit 5
    """
    store = _open_store(_settings(), upgrade_sqlite=False)
    rows = store.list_runs(status_, limit)
    if as_json:
        click.echo(json.dumps(rows))
        return
    click.echo(_table(["run", "name", "status", "total", "done", "errored", "queued", "decoder", "created"],
                      [[r["run_id"], r["name"], r["status"], r["total"], r["done"], r["errored"], r["queued"],
                        r["decoder"], r["created_at"]] for r in rows]))


@cli.command()
@click.argument("run_id", metavar="RUN")
@click.option("-o", "--output", "out_path", type=click.Path(dir_okay=False), default="-", show_default=True,
              help="Where to write OpenAI batch output lines.")
@click.option("--errors", "errors_path", type=click.Path(dir_okay=False), default=None,
              help="Write errored / expired / cancelled rows here instead of into OUTPUT.")
@click.option("--ordered", is_flag=True, help="In input-file order (default: completion order).")
def results(run_id, out_path, errors_path, ordered):
    """Export RUN's finished rows as OpenAI batch output lines.

    Example:

        canvasq results run_1a2b3c4d -o out.jsonl --errors err.jsonl --ordered
    """
    store = _open_store(_settings(), upgrade_sqlite=False)
    run_row = _get_run(store, run_id)
    out = click.open_file(out_path, "w", encoding="utf-8")
    err = click.open_file(errors_path, "w", encoding="utf-8") if errors_path else None
    try:
        n_ok, n_err = write_results(store, run_row, out, err, ordered=ordered)
    finally:
        if out_path != "-":
            out.close()
        if err is not None:
            err.close()
    click.echo(f"{n_ok} results, {n_err} errors", err=True)


@cli.command()
@click.argument("run_id", metavar="RUN")
def cancel(run_id):
    """Cancel RUN: chunks not started are cancelled now, running ones stop between decoder steps.
    Finished rows are kept.

    Example:

        canvasq cancel run_1a2b3c4d
    """
    store = _open_store(_settings(), upgrade_sqlite=False)
    run_row = _get_run(store, run_id)
    click.echo(f"{run_row.id}: {store.cancel_run(run_row.id)}")


@cli.command()
@click.argument("run_id", metavar="RUN")
@click.option("--only", default="errored,expired", show_default=True,
              help="Comma-separated request states to re-run (errored, expired, cancelled).")
def retry(run_id, only):
    """Re-run RUN's rows in the given states; finished rows stay, results merge.

    Example:

        canvasq retry run_1a2b3c4d --only errored
    """
    states = [s.strip() for s in only.split(",") if s.strip()]
    bad = [s for s in states if s not in ("errored", "expired", "cancelled")]
    if bad or not states:
        raise click.BadParameter(f"unknown state(s) {bad}; use errored, expired, cancelled", param_hint="--only")
    settings = _settings()
    store = _open_store(settings, upgrade_sqlite=False)
    run_row = _get_run(store, run_id)
    chunk_ids = store.retry_run(run_row.id, states, settings.chunk_size)
    if not chunk_ids:
        click.echo(f"{run_row.id}: no rows in {states}")
        return
    n = store.counts(run_row.id)["queued"]
    if run_row.mode == "embedded":
        _process_embedded(store, settings.model_copy(update={"model": run_row.model}), run_row.id, chunk_ids, n)
    else:
        from canvasq.worker.celery_app import publish_chunks

        publish_chunks(chunk_ids, run_row.queue, settings)
        store.mark_published(chunk_ids)
    click.echo(f"{run_row.id}: re-queued {n} rows in {len(chunk_ids)} chunks")


@cli.command()
@click.argument("run_id", metavar="RUN")
@click.argument("custom_id")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None,
              help="Write a PNG: window rows (G) and commits (τ) per forward.")
@json_option
def trace(run_id, custom_id, plot_path, as_json):
    """Per-forward trace of one request: rows in the window, commits, canvases live, ms.

    Example:

        canvasq trace run_1a2b3c4d q17 --plot q17.png
    """
    store = _open_store(_settings(), upgrade_sqlite=False)
    run_row = _get_run(store, run_id)
    rows = store.traces(run_row.id, custom_id)
    if not rows:
        raise click.ClickException(f"no trace for {custom_id!r} in {run_row.id}")
    recs = [{"forward": t.forward_index, "kind": t.kind, "rows": t.rows, "commits": t.commits,
             "own_rows": t.own_rows, "own_commits": t.own_commits, "canvases": t.canvases,
             "states": t.states, "ms": round(t.ms, 3)} for t in rows]
    if as_json:
        click.echo(json.dumps(recs))
    else:
        click.echo(_table(["forward", "kind", "rows", "commits", "own rows", "own commits", "canvases", "states",
                           "ms"], [list(r.values()) for r in recs]))
        click.echo(f"{len(recs)} forwards, {sum(r['commits'] for r in recs)} commits, "
                   f"{sum(r['rows'] for r in recs)} window rows, {sum(r['ms'] for r in recs):.1f} ms")
    if plot_path:
        plot_trace(recs, plot_path, title=f"{run_row.id} / {custom_id}")
        click.echo(f"wrote {plot_path}", err=True)


def plot_trace(recs: list[dict], path: str, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [r["forward"] for r in recs]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    colors = ["tab:blue" if r["kind"] == "decode" else "tab:gray" for r in recs]
    ax1.bar(x, [r["rows"] for r in recs], color=colors, label="window rows G (gray: encoder pass)")
    if any(r["own_rows"] is not None for r in recs):
        ax1.step(x, [r["own_rows"] or 0 for r in recs], where="mid", color="tab:orange", label="this request's rows")
    ax1.set_ylabel("rows in window")
    ax1.legend(loc="upper right")
    ax2.bar(x, [r["commits"] for r in recs], color="tab:green", label="commits τ (batch)")
    if any(r["own_commits"] is not None for r in recs):
        ax2.step(x, [r["own_commits"] or 0 for r in recs], where="mid", color="tab:orange",
                 label="this request's commits")
    ax2.set_ylabel("commits")
    ax2.set_xlabel("forward index")
    ax2.legend(loc="upper right")
    fig.suptitle(title or "per-forward trace")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


@cli.command()
@click.option("--loop", "loop_s", type=float, default=None, help="Repeat every LOOP seconds (a sidecar).")
def reconcile(loop_s):
    """Repair the queue from the store: publish chunks a crash left unpublished, re-publish chunks
    whose lease expired, expire runs past their deadline, finalise runs with no row left queued.

    Example:

        canvasq reconcile --loop 60
    """
    from canvasq.worker.reconcile import reconcile_once

    settings = _settings()
    store = _open_store(settings, upgrade_sqlite=False)
    while True:
        click.echo(reconcile_once(store, settings).line())
        if loop_s is None:
            break
        time.sleep(loop_s)


@cli.command()
@json_option
def workers(as_json):
    """Registered workers with their last heartbeat and throughput (from output rows).

    Example:

        canvasq workers
    """
    store = _open_store(_settings(), upgrade_sqlite=False)
    rows = store.worker_stats()
    if as_json:
        click.echo(json.dumps(rows))
        return
    click.echo(_table(["worker", "device", "model", "heartbeat", "requests", "tokens", "tok/s"],
                      [[r["worker"], r["device"], model_name(r["model"]), r["heartbeat_at"], r["requests"],
                        r["tokens"], _tok_s(r["tok_s"])] for r in rows]))


@cli.group()
def db():
    """Database schema (Alembic).

    Example:

        CANVASQ_DATABASE_URL=postgresql+psycopg://canvasq@db/canvasq canvasq db upgrade
    """


@db.command("upgrade")
@click.option("--revision", default="head", show_default=True)
def db_upgrade(revision):
    """Upgrade the schema of $CANVASQ_DATABASE_URL to REVISION.

    Example:

        canvasq db upgrade
    """
    from canvasq.api.store import upgrade

    url = get_settings().database_url
    upgrade(url, revision)
    click.echo(f"{mask_url(url)}: upgraded to {revision}")


@db.command("downgrade")
@click.argument("revision")
def db_downgrade(revision):
    """Downgrade the schema to REVISION ("base" drops every table).

    Example:

        canvasq db downgrade base
    """
    from canvasq.api.store import downgrade

    url = get_settings().database_url
    downgrade(url, revision)
    click.echo(f"{mask_url(url)}: downgraded to {revision}")


@db.command("current")
def db_current():
    """Print the schema revision of the database and of the code.

    Example:

        canvasq db current
    """
    from canvasq.api.store import Store, current_revision, head_revision

    store = Store.from_settings(get_settings())
    click.echo(f"{mask_url(store.url)}: {current_revision(store.engine) or 'empty'} (code: {head_revision()})")


@cli.command("config")
def config_cmd():
    """Print the effective settings (passwords masked).

    Example:

        CANVASQ_DATABASE_URL=postgresql+psycopg://u:secret@h/db canvasq config
    """
    s = get_settings()
    view = s.model_dump()
    view.update(s.describe())
    for k, v in view.items():
        click.echo(f"{k} = {v}")


# ---------------------------------------------------------------------------------------- other rooms


def _register_optional() -> None:
    """Commands written in other rooms; their modules import only click at top level."""
    import importlib

    for module, attrs in (("canvasq.testbed.cli", ("eval_cmd", "testbed")), ("canvasq.decoders.cli", ("bench",))):
        try:
            mod = importlib.import_module(module)
        except ImportError:
            continue
        for attr in attrs:
            cmd = getattr(mod, attr, None)
            if isinstance(cmd, click.Command):
                cli.add_command(cmd, name="eval" if attr == "eval_cmd" else cmd.name)


_register_optional()

if __name__ == "__main__":
    cli()
