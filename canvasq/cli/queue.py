"""Commands over the queue: `submit`, `worker`, `cancel`, `retry`, `reconcile`."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import click

from canvasq.cli.common import (
    MAX_NAME,
    check_broker,
    check_model,
    check_name,
    cli_settings,
    decoder_option,
    get_run,
    json_option,
    model_option,
    open_store,
    report_unfinished,
    say,
    validate_input,
)
from canvasq.cli.embedded import embedded_engine, owner_alive, process_embedded, refuse_if_owned
from canvasq.core.settings import mask_url

PUBLISH_BATCH = 500  # chunk messages per publish, each batch marked published before the next


@click.command()
@click.argument("file", type=click.Path(exists=True, dir_okay=False))
@click.option("--name", default=None, callback=check_name, help="A name for the run.")
@decoder_option
@model_option
@click.option(
    "--queue", default=None, callback=check_name, help="Queue to publish to (default: canvasq.<model name>)."
)
@click.option(
    "--key",
    "idempotency_key",
    default=None,
    callback=check_name,
    help="Idempotency key: submitting the same key again returns the same run, publishes nothing. "
    "Default: a hash of the file's bytes, the model, decoder, queue, chunk size and deadline.",
)
@click.option(
    "--chunk-size",
    type=click.IntRange(min=1),
    default=None,
    help="Requests per chunk (default: CANVASQ_CHUNK_SIZE).",
)
@click.option(
    "--deadline", type=click.IntRange(min=1), default=None, help="Seconds until unfinished rows expire."
)
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print one JSON line (run id, whether it was created, requests, chunks published).",
)
def submit(file, name, decoder, model, queue, idempotency_key, chunk_size, deadline, as_json):
    """Validate FILE, store the run, publish its chunks to the model's queue; print the run id.

    Rows are committed before any message is published; submitting again (or `canvasq reconcile`)
    publishes what a broker failure or a crash in between left behind. Nothing is stored or
    published when any line is invalid or the store or broker cannot be reached.

    Example:

    \b
        RUN=$(canvasq submit prompts.jsonl --name nightly --decoder auto)
        canvasq status $RUN --watch
    """
    from canvasq.core.db import file_sha256
    from canvasq.core.schemas import iter_jobs
    from canvasq.worker.celery_app import publish_chunks

    settings, limits, store = _submit_checks(file, model)
    queue = queue or settings.queue_for()
    chunk_size = chunk_size or settings.chunk_size
    deadline = deadline or settings.run_deadline_s
    digest = file_sha256(file)
    if idempotency_key is None:  # the same file with the same parameters is the same run
        params = json.dumps([digest, settings.model, decoder, queue, chunk_size, deadline])
        idempotency_key = "auto:" + hashlib.sha256(params.encode()).hexdigest()[:32]
    created = store.create_run(
        iter_jobs(file, limits),
        model=settings.model,
        queue=queue,
        decoder=decoder,
        chunk_size=chunk_size,
        name=name or Path(file).name[:MAX_NAME],
        idempotency_key=idempotency_key,
        input_path=str(Path(file).resolve()),
        input_sha256=digest,
        deadline_s=deadline,
    )
    run_queue, todo = _publish_submitted(store, settings, created, queue, publish_chunks)
    existing_name = None if created.created else store.get_run(created.run_id).name
    if as_json:
        click.echo(
            json.dumps(
                {
                    "run_id": created.run_id,
                    "created": created.created,
                    "requests": created.requests,
                    "chunks": len(created.chunk_ids),
                    "published": len(todo),
                    "queue": run_queue,
                    "name": name or Path(file).name[:MAX_NAME] if created.created else existing_name,
                    "idempotency_key": idempotency_key,
                }
            )
        )
        return
    _say_submitted(created, queue, todo, name, existing_name, idempotency_key)
    click.echo(created.run_id)


def _submit_checks(file, model):
    """(settings, limits, store) once the file, the model, the store and the broker all pass: nothing
    is stored when any of them would fail."""
    settings = cli_settings(model)
    limits, _ = validate_input(file, settings)
    if Path(settings.model).is_dir() or settings.model.startswith("random:"):
        check_model(settings)  # a model that lives only on the workers is theirs to check
    store = open_store(settings)
    check_broker(settings)
    return settings, limits, store


def _publish_submitted(store, settings, created, queue: str, publish_chunks) -> tuple[str, list[str]]:
    """Publish a new run's chunks, or what an earlier submit of the same key left unpublished, to the
    run's own queue; (that queue, the chunk ids published)."""
    run_queue = queue if created.created else store.get_run(created.run_id).queue
    todo = created.chunk_ids if created.created else [c for c, _ in store.unpublished_chunks(created.run_id)]
    for i in range(0, len(todo), PUBLISH_BATCH):  # marked batch by batch: a crash re-publishes little
        part = todo[i : i + PUBLISH_BATCH]
        try:
            publish_chunks(part, run_queue, settings)
        except Exception as exc:  # noqa: BLE001 - the rows are stored; say how to finish the job
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise click.ClickException(
                f"run {created.run_id} is stored but publishing its chunks to {run_queue} failed ({mask_url(first)}); "
                "run the same `canvasq submit` again (or `canvasq reconcile`) once the broker is back"
            ) from None
        store.mark_published(part)
    return run_queue, todo


def _say_submitted(created, queue: str, todo: list[str], name, existing_name, idempotency_key: str) -> None:
    """The stderr line: what was submitted, or which run the key already names and what was published."""
    if created.created:
        click.echo(
            f"submitted {created.requests} requests in {len(created.chunk_ids)} chunks to {queue}", err=True
        )
        return
    renamed = (
        f" (named {existing_name!r}; --name {name!r} was not applied)"
        if name and name != existing_name
        else ""
    )
    published = (
        f"published its {len(todo)} unpublished chunk(s)"
        if todo
        else "nothing published (every chunk was published before)"
    )
    click.echo(
        f"key {idempotency_key!r} already submitted as {created.run_id}: returned the existing run"
        f"{renamed}; {published}. A different --key submits the file again as a new run",
        err=True,
    )


@click.command()
@model_option
@click.option("--queue", default=None, help="Queue to consume (default: canvasq.<model name>).")
@click.option(
    "--concurrency",
    type=int,
    default=1,
    show_default=True,
    help="Child processes; keep 1 per GPU (start one worker per CUDA_VISIBLE_DEVICES).",
)
@click.option("--loglevel", default="INFO", show_default=True)
@click.option(
    "--pool",
    type=click.Choice(["prefork", "solo"]),
    default="prefork",
    show_default=True,
    help="prefork loads the model in a child (CUDA never touches the parent).",
)
@click.option(
    "--gpu",
    default=None,
    metavar="N|auto",
    help="Set CUDA_VISIBLE_DEVICES=N, or claim a free slot of CANVASQ_GPU_SLOTS in Redis (auto).",
)
def worker(model, queue, concurrency, loglevel, pool, gpu):
    """Start a Celery worker process for one model (one per GPU).

    Refuses to start unless visibility_timeout > hard_time_limit > soft_time_limit. The model is
    loaded once in the child; the worker registers itself (host, device, model) and heartbeats.

    Example:

    \b
        CUDA_VISIBLE_DEVICES=0 canvasq worker --model /models/diffusiongemma &
        CUDA_VISIBLE_DEVICES=1 canvasq worker --model /models/diffusiongemma &
        CANVASQ_GPU_SLOTS=8 canvasq worker --gpu auto    # containers that see all GPUs
    """
    settings = _worker_settings(model)
    queue = queue or settings.queue_for()
    os.environ["CANVASQ_WORKER_QUEUE"] = queue
    slot = _bind_gpu(gpu, settings)
    store = open_store(settings, upgrade_sqlite=False)
    store.dispose()
    from canvasq.worker.celery_app import app

    click.echo(
        f"worker for {settings.model} on queue {queue}; broker {mask_url(settings.broker_url)}; "
        f"store {mask_url(settings.database_url)}",
        err=True,
    )
    try:
        app.worker_main(
            [
                "worker",
                "-Q",
                queue,
                "-c",
                str(concurrency),
                "-P",
                pool,
                "-l",
                loglevel,
                "-n",
                f"canvasq-{os.getpid()}@%h",
                "--without-gossip",
                "--without-mingle",
            ]
        )
    finally:
        if slot is not None:
            slot.release()


def _worker_settings(model):
    """The worker's settings, from the environment the child inherits, refused before any GPU is
    claimed when the time limits disagree or the model would not load."""
    from canvasq.core.settings import reload_settings

    if model:
        os.environ["CANVASQ_MODEL"] = model
    settings = reload_settings()
    try:
        settings.check_time_limits()
    except ValueError as exc:
        raise click.ClickException(f"refusing to start: {exc}") from None
    check_model(settings)  # the child loads it: a missing or corrupt model fails here, not per chunk
    return settings


def _bind_gpu(gpu, settings):
    """Point CUDA_VISIBLE_DEVICES (inherited by the child) at --gpu N, or at a slot claimed in Redis
    for --gpu auto; that slot, kept alive by its refresher until released, or None."""
    slot = None
    if gpu == "auto":
        import socket

        from canvasq.worker.gpu_slots import NoFreeSlot, claim_slot

        if not settings.gpu_slots:
            raise click.ClickException("--gpu auto needs CANVASQ_GPU_SLOTS (GPUs on this host)")
        try:
            slot = claim_slot(
                settings.broker_url, settings.gpu_host or socket.gethostname(), settings.gpu_slots
            )
        except NoFreeSlot as exc:
            raise click.ClickException(str(exc)) from None
        slot.start_refresher()
        os.environ["CUDA_VISIBLE_DEVICES"] = str(slot.slot)
    elif gpu is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = gpu
    return slot


@click.command()
@click.argument("run_id", metavar="RUN")
@json_option
def cancel(run_id, as_json):
    """Cancel RUN: chunks not started are cancelled now, running ones stop between decoder steps.
    Finished rows are kept.

    Example:

    \b
        canvasq cancel run_1a2b3c4d
    """
    settings = cli_settings()
    store = open_store(settings, upgrade_sqlite=False)
    run_row = get_run(store, run_id)
    # nobody holds an interrupted embedded run's chunks to see the flag: cancel their rows now
    orphaned = run_row.mode == "embedded" and not owner_alive(store.embedded_owner(run_row.id), settings)
    status = store.cancel_run(run_row.id, close_running=orphaned)
    say(as_json, f"{run_row.id}: {status}", run_id=run_row.id, status=status, counts=store.counts(run_row.id))


@click.command()
@click.argument("run_id", metavar="RUN")
@click.option(
    "--only",
    default="errored,expired",
    show_default=True,
    help="Comma-separated request states to re-run (errored, expired, cancelled), and/or stuck: "
    "queued rows no live worker will finish (their worker stopped heartbeating).",
)
@json_option
def retry(run_id, only, as_json):
    """Re-run RUN's rows in the given states; finished rows stay, results merge.

    `stuck` re-publishes, in new chunks, the queued rows whose chunk is held by a worker without a
    recent heartbeat or under an expired lease (what `reconcile` would re-publish), or that a
    chunk left behind; rows a live worker holds or that wait in the queue are left alone.

    Example:

    \b
        canvasq retry run_1a2b3c4d --only errored
        canvasq retry run_1a2b3c4d --only stuck
    """
    from datetime import timedelta

    from canvasq.core.tables import utcnow

    states = _retry_states(only)
    settings = cli_settings()
    store = open_store(settings, upgrade_sqlite=False)
    run_row = get_run(store, run_id)
    embedded = run_row.mode == "embedded"
    engine = None
    if embedded:  # load the model before any row changes state
        engine = _retry_engine(store, settings, run_row)
    else:
        check_broker(settings)
    before = store.counts(run_row.id)
    offline_before = utcnow() - timedelta(seconds=settings.offline_after_s)
    stuck = len(store.stuck_rows(run_row.id, offline_before)) if "stuck" in states else 0
    n = sum(before[s] for s in states if s != "stuck") + stuck
    # the run's own chunk size (a run from before it was stored: the largest chunk it has)
    chunk_size = run_row.chunk_size or store.largest_chunk(run_row.id) or settings.chunk_size
    chunk_ids = store.retry_run(run_row.id, states, chunk_size, offline_before=offline_before)
    if not embedded:
        _publish_retried(store, settings, run_row, states, chunk_ids, before, n, chunk_size, as_json)
        return
    _rerun_embedded(store, engine, run_row, states, n, as_json)


def _retry_states(only: str) -> list[str]:
    """--only as a list of states, refused when empty or naming an unknown state."""
    states = [s.strip() for s in only.split(",") if s.strip()]
    bad = [s for s in states if s not in ("errored", "expired", "cancelled", "stuck")]
    if bad or not states:
        raise click.BadParameter(
            f"unknown state(s) {bad}; use errored, expired, cancelled, stuck", param_hint="--only"
        )
    return states


def _retry_engine(store, settings, run_row):
    """An embedded run's engine with its model loaded, refused while another process owns the run."""
    refuse_if_owned(store, settings, run_row.id)
    run_settings = settings.model_copy(update={"model": run_row.model})
    check_model(run_settings)
    return embedded_engine(store, run_settings)


def _publish_retried(store, settings, run_row, states, chunk_ids, before, n, chunk_size, as_json) -> None:
    """A queued run's retried rows go to its queue in their new chunks; with none, say why the queued
    rows (if any) were left alone."""
    if not chunk_ids:
        waiting = (
            f"; {before['queued']} queued rows are held by live workers or wait in the queue"
            if "stuck" in states and before["queued"]
            else ""
        )
        say(
            as_json,
            f"{run_row.id}: no rows in {states}{waiting}",
            run_id=run_row.id,
            states=states,
            rows=0,
            chunks=0,
            queued=before["queued"],
        )
        return
    from canvasq.worker.celery_app import publish_chunks

    publish_chunks(chunk_ids, run_row.queue, settings)
    store.mark_published(chunk_ids)
    say(
        as_json,
        f"{run_row.id}: re-queued {n} rows in {len(chunk_ids)} chunks of up to {chunk_size}",
        run_id=run_row.id,
        states=states,
        rows=n,
        chunks=len(chunk_ids),
        chunk_size=chunk_size,
    )


def _rerun_embedded(store, engine, run_row, states, n, as_json) -> None:
    """An embedded run's queued rows are decoded here and now, with any an interruption left queued."""
    left = store.counts(run_row.id)["queued"]  # the retried rows and any an interruption left queued
    if not left:
        say(as_json, f"{run_row.id}: no rows in {states}", run_id=run_row.id, states=states, rows=0, chunks=0)
        return
    process_embedded(engine, run_row.id)
    extra = f" and {left - n} left unfinished by an interruption" if left > n else ""
    say(
        as_json,
        f"{run_row.id}: re-ran {n} rows in {states}{extra}",
        run_id=run_row.id,
        states=states,
        rows=n,
        left_by_interruption=max(0, left - n),
        counts=store.counts(run_row.id),
        status=store.run_status(run_row.id),
    )
    report_unfinished(store, run_row.id)


@click.command()
@click.option("--loop", "loop_s", type=float, default=None, help="Repeat every LOOP seconds (a sidecar).")
def reconcile(loop_s):
    """Repair the queue from the store: publish chunks a crash left unpublished, re-publish chunks
    whose lease expired, expire runs past their deadline, finalise runs with no row left queued.

    Workers already run this every CANVASQ_RECONCILE_S seconds (15; one worker per interval across
    the fleet); run it by hand, or as a sidecar where workers run with CANVASQ_RECONCILE_S=0.
    A pass by hand publishes every unpublished chunk; with --loop (like the workers' passes) only
    those stored over a minute ago, so a submit still publishing its chunks is not doubled.

    Example:

    \b
        canvasq reconcile --loop 60
    """
    from canvasq.worker.reconcile import OUTBOX_GRACE_S, reconcile_once

    settings = cli_settings()
    store = open_store(settings, upgrade_sqlite=False)
    grace = 0.0 if loop_s is None else OUTBOX_GRACE_S
    while True:
        click.echo(reconcile_once(store, settings, outbox_grace_s=grace).line())
        if loop_s is None:
            break
        time.sleep(loop_s)
