"""`canvasq`: one click group for submitting, running, watching and exporting generation runs.

Heavy imports (torch, transformers, the decoders) happen only inside the commands that generate
(`run`, `worker`'s child, `retry` of an embedded run); `canvasq --help` imports click, pydantic and
nothing else heavy. Settings come from `CANVASQ_*` variables (see `canvasq.api.settings`).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import sys
import time
import uuid
from pathlib import Path

import click

from canvasq.api.settings import DECODERS, get_settings, mask_url, model_name, resolve_experts

RUN_STATUS_CHOICES = ("queued", "running", "completed", "cancelling", "cancelled", "expired", "interrupted")
MAX_NAME = 200  # the store's name / queue / key columns

# Settings that never change what a run generates; every other one is part of an embedded run's
# identity (a setting added later counts by default: it starts a new run rather than mixing outputs).
_NOT_IDENTITY = {"database_url", "broker_url", "soft_time_limit", "hard_time_limit", "visibility_timeout",
                 "max_attempts", "heartbeat_s", "run_deadline_s", "sqlite_busy_timeout_ms", "max_errors",
                 "queue_prefix", "gpu_slots", "gpu_host", "torch_threads", "cuda_graphs", "chunk_size",
                 "w4_cache_dir"}


# ---------------------------------------------------------------------------------------- shared


def decoder_option(f):
    return click.option(
        "--decoder", type=click.Choice(DECODERS), default="auto", show_default=True,
        help="Decoding algorithm; auto = official (the accurate sampler) unless CANVASQ_ROUTING names a decoder for the task; hf = HF generate() (reference).",
    )(f)


def model_option(f):
    return click.option(
        "--model", "model", default=None, metavar="PATH|random:26b-a4b",
        help="Model spec (default: $CANVASQ_MODEL, else the repo's models/testbed).",
    )(f)


def json_option(f):
    return click.option("--json", "as_json", is_flag=True, help="Print one JSON line instead of a table.")(f)


class _Group(click.Group):
    """Known failures (settings, database, broker, file system) end as one line and exit 1, never a
    traceback; anything else is a bug and keeps its traceback."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except (click.exceptions.ClickException, click.exceptions.Exit, click.exceptions.Abort, SystemExit):
            raise
        except Exception as exc:
            line = _failure_line(exc)
            if line is None:
                raise
            raise click.ClickException(line) from None


def _failure_line(exc: Exception) -> str | None:
    from canvasq.api.schemas import InputError
    from canvasq.api.settings import settings_error_line

    line = settings_error_line(exc)
    if line:
        return line
    if isinstance(exc, InputError):  # the file changed between validation and storing
        return f"{exc.report.path} changed while it was read: {exc.report.errors[0] if exc.report.errors else ''}"
    mod = type(exc).__module__.split(".")[0]
    first = (str(getattr(exc, "orig", None) or exc).strip().splitlines() or [type(exc).__name__])[0]
    if mod == "sqlalchemy":
        return f"database error ({type(exc).__name__}): {mask_url(first)}"
    if mod in ("kombu", "redis", "amqp"):
        return f"broker error ({type(exc).__name__}): {mask_url(first)}"
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.filename}: {exc.strerror}" if exc.filename else exc.strerror
    return None


def _settings(model: str | None = None):
    s = get_settings()
    if model and len(model) > 500:
        raise click.BadParameter("the model spec is longer than 500 characters", param_hint="--model")
    return s.model_copy(update={"model": model}) if model else s


def _check_name(_ctx, param, value):
    if value is not None and len(value) > MAX_NAME:
        raise click.BadParameter(f"{len(value)} characters; the limit is {MAX_NAME}")
    return value


def _check_model(settings) -> None:
    from canvasq.api.schemas import model_problem

    problem = model_problem(settings.model)
    if problem:
        raise click.ClickException(f"{problem} (CANVASQ_MODEL / --model)")


def _check_broker(settings) -> None:
    """Connect to the broker once, so a down or misspelt broker fails before anything is stored."""
    from kombu import Connection

    try:
        with Connection(settings.broker_url, connect_timeout=5) as conn:
            conn.ensure_connection(max_retries=1, interval_start=0, timeout=10)
    except Exception as exc:  # noqa: BLE001 - any failure to connect is the same message
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise click.ClickException(f"cannot reach the broker CANVASQ_BROKER_URL={mask_url(settings.broker_url)}: "
                                   f"{mask_url(first)}") from None


def _open_store(settings, *, upgrade_sqlite: bool = True):
    """The store; a SQLite database is created / upgraded on first use, a server database must be
    upgraded explicitly (`canvasq db upgrade`, the compose file's one-shot migration)."""
    from sqlalchemy.exc import SQLAlchemyError

    from canvasq.api.store import SchemaOutOfDate, Store, database_problem

    problem = database_problem(settings.database_url)
    if problem:
        raise click.ClickException(problem)
    store = Store.from_settings(settings)
    try:
        store.check_schema()
    except SchemaOutOfDate as exc:
        if store.dialect != "sqlite" or not upgrade_sqlite:
            raise click.ClickException(str(exc)) from None
        store.upgrade()
    except SQLAlchemyError as exc:
        first = (str(getattr(exc, "orig", None) or exc).strip().splitlines() or ["?"])[0]
        raise click.ClickException(f"cannot use the database CANVASQ_DATABASE_URL={mask_url(store.url)}: "
                                   f"{mask_url(first)}") from None
    return store


def _database_url() -> str:
    from canvasq.api.store import database_problem

    url = get_settings().database_url
    problem = database_problem(url)
    if problem:
        raise click.ClickException(problem)
    return url


class _Output:
    """An output file written whole or not at all: a temporary file beside the target, renamed over
    it by `commit`. Opened before any generation, so a missing directory, a device (`/dev/full`), a
    read-only place or the input file itself fails at once and the old file stays as it was."""

    def __init__(self, path: str, input_path: str | None = None):
        import tempfile

        target = Path(os.path.realpath(path)) if Path(path).is_symlink() else Path(path)  # write through links
        if input_path is not None and os.path.realpath(target) == os.path.realpath(input_path):
            raise click.ClickException(f"-o {path} is the input file; choose another output path")
        if target.exists() and not target.is_file():
            raise click.ClickException(f"-o {path} is not a regular file")
        parent = target.absolute().parent
        if not parent.is_dir():
            raise click.ClickException(f"-o {path}: directory {parent} does not exist")
        prefix = f".{target.name[:100]}."
        try:
            fd, self.tmp = tempfile.mkstemp(dir=parent, prefix=f"{prefix}{os.getpid()}.", suffix=".tmp")
        except OSError as exc:
            raise click.ClickException(f"-o {path}: cannot write in {parent}: {exc.strerror}") from None
        self.path, self.fh = target, os.fdopen(fd, "w", encoding="utf-8")
        for stale in parent.glob(f"{glob.escape(prefix)}*.tmp"):  # left by a killed process
            pid = stale.name[len(prefix):].split(".", 1)[0]
            if pid.isdigit() and int(pid) != os.getpid() and not _pid_exists(int(pid)):
                stale.unlink(missing_ok=True)

    def commit(self) -> None:
        try:
            self.fh.flush()
            os.fsync(self.fh.fileno())
            self.fh.close()
            mode = self.path.stat().st_mode & 0o777 if self.path.exists() else 0o666 & ~_umask()
            os.chmod(self.tmp, mode)
            os.replace(self.tmp, self.path)
        except OSError as exc:
            self.discard()
            raise click.ClickException(f"-o {self.path}: {exc.strerror}; the old file is unchanged") from None

    def discard(self) -> None:
        self.fh.close()
        try:
            os.unlink(self.tmp)
        except FileNotFoundError:
            pass


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


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


def _slot_use(occupancy: list[tuple[int, int]]) -> dict | None:
    """Decode slot use over a run's steps: mean share busy, and for how much of the run all were."""
    if not occupancy:
        return None
    steps = len(occupancy)
    first_short = next((i for i, (n, k) in enumerate(occupancy) if n < k), steps)
    return {"slots": max(k for _, k in occupancy), "steps": steps,
            "mean": sum(n for n, _ in occupancy) / sum(k for _, k in occupancy), "full_until": first_short / steps}


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


def _status_line(s: dict) -> str:
    """One progress line from `Store.run_summary`. The bar: `#` generated (done or errored), `x` not
    generated (cancelled or expired), `>` in flight (rows a worker holds), `-` waiting; the count is
    the generated rows, so a cancelled run never shows a full bar."""
    c, width = s["counts"], 30
    total = c["total"] or 1
    gen, closed = c["done"] + c["errored"], c["cancelled"] + c["expired"]
    cells = [int(width * gen / total), int(width * (gen + closed) / total),
             int(width * (gen + closed + s.get("in_flight", 0)) / total)]
    bar = "#" * cells[0] + "x" * (cells[1] - cells[0]) + ">" * (cells[2] - cells[1]) + "-" * (width - cells[2])
    return (f"{s['run_id']} [{bar}] {gen}/{c['total']} generated  {s['status']}  done {c['done']} errored "
            f"{c['errored']} expired {c['expired']} cancelled {c['cancelled']} queued {c['queued']} "
            f"(in flight {s.get('in_flight', 0)})  tokens {s['completion_tokens']}  "
            f"tok/s {_tok_s(s['tok_s']) or '-'}  ETA {_fmt_s(s['eta_s'])}")


def cut_at_stop(text: str, stop: list[str] | None, finish_reason: str | None) -> tuple[str, str | None]:
    """OpenAI `stop`: the text ends before the earliest stop sequence, which is not included, and the
    finish reason is then "stop". The decoders generate whole canvases, so the cut is made here."""
    cuts = [i for i in (text.find(x) for x in stop or () if x) if i >= 0]
    return (text[:min(cuts)], "stop") if cuts else (text, finish_reason)


def write_results(store, run, out, errors_out=None, ordered: bool = False,
                  error_codes: dict[str, str] | None = None) -> tuple[int, int]:
    """Write OpenAI batch output lines; errored/expired/cancelled rows go to `errors_out` when given.
    `error_codes` renames stored error codes (the Batch API writes `expired` as `batch_expired`)."""
    from canvasq.api.schemas import output_line

    n_ok = n_err = 0
    name = model_name(run.model)
    for row in store.iter_results(run.id, ordered=ordered):
        o = row["output"]
        rid = uuid.uuid5(uuid.NAMESPACE_URL, f"canvasq:{run.id}:{row['custom_id']}").hex
        if row["status"] == "done" and o is not None and o.error_code is None:
            text, finish = cut_at_stop(o.text or "", row.get("stop"), o.finish_reason)
            line = output_line(custom_id=row["custom_id"], model=name, text=text, finish_reason=finish,
                               prompt_tokens=o.prompt_tokens, completion_tokens=o.completion_tokens,
                               request_id=rid, created=o.updated_at.timestamp(),
                               extra_usage={"forwards": o.forwards, "decoder": o.decoder})
            target, n_ok = out, n_ok + 1
        else:
            code = (o.error_code if o is not None and o.error_code else row["status"])
            code = (error_codes or {}).get(code, code)
            msg = (o.error_message if o is not None and o.error_message else f"request {row['status']}")
            line = output_line(custom_id=row["custom_id"], model=name, error_code=code, error_message=msg,
                               request_id=rid)
            target, n_err = (errors_out or out), n_err + 1
        target.write(json.dumps(line, ensure_ascii=False) + "\n")
    return n_ok, n_err


def _embedded_key(digest: str, settings, decoder: str, chunk_size: int) -> str:
    """An embedded run's identity: the input's bytes and every setting that shapes its outputs.
    Rerunning the same `canvasq run` finds the run by this key and continues it."""
    ident = {k: v for k, v in settings.model_dump(mode="json").items() if k not in _NOT_IDENTITY}
    if Path(settings.model).is_dir():  # models/testbed and /abs/.../models/testbed are one model
        ident["model"] = str(Path(settings.model).resolve())
    params = json.dumps([digest, decoder, chunk_size, ident], sort_keys=True, default=str)
    return "embedded:" + hashlib.sha256(params.encode()).hexdigest()[:32]


def _owner_alive(owner, settings) -> bool:
    """Is the process that generated an embedded run still at it? Same host: its pid runs canvasq
    (a reused pid does not count); another host sharing the store: its heartbeat is recent."""
    import socket

    from canvasq.api.models import utcnow

    if owner is None:
        return False
    if owner.host == socket.gethostname():
        if owner.pid == os.getpid():
            return False
        try:
            return b"canvasq" in Path(f"/proc/{owner.pid}/cmdline").read_bytes()  # empty for a zombie
        except OSError:
            pass
        try:
            os.kill(owner.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    return (utcnow() - owner.heartbeat_at).total_seconds() < 3 * settings.heartbeat_s + 10


def _reap_interrupted(store, settings) -> None:
    """Mark embedded runs whose process died (SIGKILL, a crash, a reboot) `interrupted`."""
    for run_id in store.active_embedded_runs():
        if not _owner_alive(store.embedded_owner(run_id), settings):
            store.mark_interrupted(run_id)


def _refuse_if_owned(store, settings, run_id: str) -> None:
    owner = store.embedded_owner(run_id)
    if _owner_alive(owner, settings):
        raise click.ClickException(f"run {run_id} is being generated by process {owner.pid} on {owner.host}; "
                                   f"wait for it or `canvasq cancel {run_id}`")


def _embedded_runtime(store, settings):
    """A ChunkRuntime with the model loaded: a model that does not load fails here, before any run
    is created or changed."""
    import socket

    from canvasq.worker.runtime import ChunkRuntime

    rt = ChunkRuntime(settings=settings, store=store, worker_id=f"embedded:{socket.gethostname()}:{os.getpid()}",
                      queue="embedded")
    click.echo(f"loading {settings.model} ...", err=True)
    try:
        rt.bundle  # noqa: B018 - load before any run is touched
    except Exception as exc:  # noqa: BLE001 - whatever broke, the model is the setting to fix
        first = (str(exc).strip().splitlines() or [""])[0]
        raise click.ClickException(f"cannot load the model {settings.model} (CANVASQ_MODEL / --model): "
                                   f"{type(exc).__name__}: {first}") from None
    return rt


# `canvasq run`'s chunk: chunks spread a run over fleet workers; the embedded runner is one worker, and
# its decode stream drains at each chunk's end, so its chunks are large (rows are still stored one by
# one as they finish: a rerun after a kill continues from the rows stored)
EMBEDDED_CHUNK = 4096


PROGRESS_EVERY_S = 10.0  # `canvasq run` off a terminal: a progress line this often


class _ProgressLines:
    """click.progressbar's interface for a log (stderr not a terminal): one line every
    PROGRESS_EVERY_S seconds while rows finish, and one at the end, instead of a bar drawn in place."""

    def __init__(self, length: int, label: str = "", file=None, **_bar_options):
        self.length, self.label, self.file, self.pos = length, label, file or sys.stderr, 0
        self.t0 = self.last = time.monotonic()

    def __enter__(self):
        click.echo(f"{self.label}: {self.length} rows", file=self.file)
        return self

    def __exit__(self, *exc):
        self._line()

    def update(self, n: int) -> None:
        self.pos += n
        if time.monotonic() - self.last >= PROGRESS_EVERY_S:
            self._line()

    def _line(self) -> None:
        self.last = time.monotonic()
        elapsed = self.last - self.t0
        rate = self.pos / elapsed if elapsed > 0 else 0.0
        eta = (self.length - self.pos) / rate if rate and self.pos < self.length else None
        pct = 100 * self.pos / self.length if self.length else 100.0
        click.echo(f"{self.label}: {self.pos}/{self.length} rows ({pct:.0f} %), {_fmt_s(elapsed)} elapsed, "
                   f"{rate:.2f} rows/s, ETA {_fmt_s(eta)}", file=self.file)


def _raise_interrupt(_signum, _frame):
    raise KeyboardInterrupt


def _process_embedded(rt, run_id: str) -> list[tuple[int, int]]:
    """Generate every chunk of `run_id` that still holds queued rows; returns the decode slots' use per
    step (live rows, slots). Ctrl-C or SIGTERM marks the run `interrupted` and exits 130; rows stored
    before stay, and the same command continues."""
    import signal

    occupancy: list[tuple[int, int]] = []
    store = rt.store
    rt.queue = f"embedded:{run_id}"  # the run's owner, for `_owner_alive`
    rt.register()
    store.resume_run(run_id)  # `running` again even if a `canvasq runs` saw it between create and register
    rt.start_heartbeat()
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        queued = store.counts(run_id)["queued"]
        bar_cls = click.progressbar if sys.stderr.isatty() else _ProgressLines
        with bar_cls(length=queued, label="generating", file=sys.stderr, show_eta=True,
                     show_percent=True, show_pos=True) as bar:
            rt.on_row = lambda: bar.update(1)  # each row as it finishes, not each chunk
            for cid in store.pending_chunks(run_id):
                occupancy += rt.process_chunk(cid).get("occupancy", [])
                settled = queued - store.counts(run_id)["queued"]  # also rows closed without decoding
                bar.update(max(0, settled - bar.pos))
            rt.on_row = None
        store.finalize_run(run_id)
        click.echo(f"engine: {json.dumps(rt.bundle.engine())}", err=True)  # device, experts, graphs
        return occupancy
    except KeyboardInterrupt:
        store.mark_interrupted(run_id, release_chunks=True)
        c = store.counts(run_id)
        click.echo(f"\ninterrupted: run {run_id} has {c['queued']} of {c['total']} rows left; run the same "
                   "command again to continue", err=True)
        raise SystemExit(130) from None
    finally:
        signal.signal(signal.SIGTERM, previous)
        rt.stop()


# ---------------------------------------------------------------------------------------- the group


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
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
@click.option("--name", default=None, callback=_check_name, help="A name for the run.")
@click.option("--chunk-size", type=click.IntRange(min=1), default=None,
              help=f"Requests per chunk (default: {EMBEDDED_CHUNK}: one worker drains the file, and a chunk's "
                   "continuous batching keeps the decode slots full until its last rows).")
@click.option("--fresh", is_flag=True, help="Start over even if an earlier run of the same file and settings exists.")
@json_option
def run(file, out_path, decoder, model, name, chunk_size, fresh, as_json):
    """Generate FILE in this process (embedded mode: SQLite store, no broker, no worker).

    Checks everything first (every input line, the output path, the store, the model: nothing runs
    on any error), decodes in chunks with a progress bar, writes OpenAI batch output lines (to a
    temporary file renamed into place) and prints requests, tokens, forwards per request and tok/s
    per decoder. The same command again (same file bytes, same settings) continues an interrupted
    run and reuses every row it finished.

    Example:

        canvasq run examples/prompts.jsonl -o results.jsonl --decoder auto
    """
    from canvasq.api.schemas import iter_jobs
    from canvasq.api.store import file_sha256

    settings = _settings(model)
    limits, _ = _validate(file, settings)
    out_path = out_path or f"{Path(file).stem}.results.jsonl"
    output = _Output(out_path, input_path=file)
    try:
        _check_model(settings)
        store = _open_store(settings)
        chunk_size = chunk_size or EMBEDDED_CHUNK
        digest = file_sha256(file)
        key = _embedded_key(digest, settings, decoder, chunk_size)
        earlier = None if fresh else store.run_by_key(key)
        if earlier is not None:
            _refuse_if_owned(store, settings, earlier)
        # the model loads before a run is created, so a model that fails to load leaves none behind
        rt = _embedded_runtime(store, settings) if earlier is None or store.pending_chunks(earlier) else None
        created = store.create_run(
            iter_jobs(file, limits), model=settings.model, queue="embedded", decoder=decoder,
            chunk_size=chunk_size, name=name or Path(file).name[:MAX_NAME],
            idempotency_key=key, replace_key=fresh,
            input_path=str(Path(file).resolve()), input_sha256=digest, mode="embedded",
        )
        run_id, reused = created.run_id, 0
        if created.created:
            click.echo(f"run {run_id}: {created.requests} requests, {len(created.chunk_ids)} chunks "
                       f"(store {mask_url(store.url)})", err=True)
        else:
            c, was = store.counts(run_id), store.run_status(run_id)
            reused = c["total"] - c["queued"]
            click.echo(f"resuming run {run_id} ({was}): {reused} of {c['total']} rows reused, {c['queued']} to "
                       "generate (--fresh starts over)", err=True)
            if was in ("cancelled", "expired"):
                click.echo(f"run {run_id} was {was}: `canvasq retry {run_id} --only {was}` re-runs those rows",
                           err=True)
            store.resume_run(run_id)
        t0 = time.perf_counter()
        occupancy = []
        if rt is not None:
            occupancy = _process_embedded(rt, run_id)
        else:
            store.finalize_run(run_id)
        wall = time.perf_counter() - t0
        n_ok, n_err = write_results(store, _get_run(store, run_id), output.fh, ordered=True)
        output.commit()
    except BaseException:
        output.discard()
        raise
    summary = store.run_summary(run_id)
    summary["process_wall_s"] = wall
    summary["reused"] = reused
    summary["slots"] = _slot_use(occupancy)
    if as_json:
        click.echo(json.dumps(summary, default=str))
    else:
        click.echo(_summary_table(summary))
        if summary["slots"]:
            u = summary["slots"]
            click.echo(f"decode slots: {u['slots']}, {u['mean'] * 100:.0f} % full over {u['steps']} steps "
                       f"(every slot busy for the first {u['full_until'] * 100:.0f} % of them)")
        click.echo(f"wrote {n_ok} results and {n_err} errors to {out_path} in {wall:.1f}s"
                   + (f"; {reused} rows reused from the earlier run" if reused else ""))
    _report_unfinished(store, run_id)


MISSING_SHOWN = 20  # custom_ids of unfinished rows named in a report


def _report_unfinished(store, run_id: str) -> None:
    """Rows not in the output because they are not terminal: always said, and named, never a silent gap."""
    c = store.counts(run_id)
    if c["queued"]:
        missing = store.missing_rows(run_id, MISSING_SHOWN)
        more = f" and {c['queued'] - len(missing)} more" if c["queued"] > len(missing) else ""
        click.echo(f"{c['queued']} of {c['total']} rows of {run_id} are not finished ({store.run_status(run_id)}) "
                   f"and are not in the output: {', '.join(missing)}{more}", err=True)


@cli.command()
@click.argument("file", type=click.Path(exists=True, dir_okay=False))
@click.option("--name", default=None, callback=_check_name, help="A name for the run.")
@decoder_option
@model_option
@click.option("--queue", default=None, callback=_check_name, help="Queue to publish to (default: canvasq.<model name>).")
@click.option("--key", "idempotency_key", default=None, callback=_check_name,
              help="Idempotency key: submitting the same key again returns the same run, publishes nothing. "
                   "Default: a hash of the file's bytes, the model, decoder, queue, chunk size and deadline.")
@click.option("--chunk-size", type=click.IntRange(min=1), default=None,
              help="Requests per chunk (default: CANVASQ_CHUNK_SIZE).")
@click.option("--deadline", type=click.IntRange(min=1), default=None, help="Seconds until unfinished rows expire.")
@click.option("--json", "as_json", is_flag=True,
              help="Print one JSON line (run id, whether it was created, requests, chunks published).")
def submit(file, name, decoder, model, queue, idempotency_key, chunk_size, deadline, as_json):
    """Validate FILE, store the run, publish its chunks to the model's queue; print the run id.

    Rows are committed before any message is published; submitting again (or `canvasq reconcile`)
    publishes what a broker failure or a crash in between left behind. Nothing is stored or
    published when any line is invalid or the store or broker cannot be reached.

    Example:

        RUN=$(canvasq submit prompts.jsonl --name nightly --decoder auto)
        canvasq status $RUN --watch
    """
    from canvasq.api.schemas import iter_jobs
    from canvasq.api.store import file_sha256
    from canvasq.worker.celery_app import publish_chunks

    settings = _settings(model)
    limits, _ = _validate(file, settings)
    if Path(settings.model).is_dir() or settings.model.startswith("random:"):
        _check_model(settings)  # a model that lives only on the workers is theirs to check
    store = _open_store(settings)
    _check_broker(settings)
    queue = queue or settings.queue_for()
    chunk_size = chunk_size or settings.chunk_size
    deadline = deadline or settings.run_deadline_s
    digest = file_sha256(file)
    if idempotency_key is None:  # the same file with the same parameters is the same run
        params = json.dumps([digest, settings.model, decoder, queue, chunk_size, deadline])
        idempotency_key = "auto:" + hashlib.sha256(params.encode()).hexdigest()[:32]
    created = store.create_run(
        iter_jobs(file, limits), model=settings.model, queue=queue, decoder=decoder,
        chunk_size=chunk_size, name=name or Path(file).name[:MAX_NAME],
        idempotency_key=idempotency_key, input_path=str(Path(file).resolve()), input_sha256=digest,
        deadline_s=deadline,
    )
    run_queue = queue if created.created else store.get_run(created.run_id).queue
    todo = created.chunk_ids if created.created else [c for c, _ in store.unpublished_chunks(created.run_id)]
    if todo:
        try:
            publish_chunks(todo, run_queue, settings)
        except Exception as exc:  # noqa: BLE001 - the rows are stored; say how to finish the job
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise click.ClickException(
                f"run {created.run_id} is stored but publishing its chunks to {run_queue} failed ({mask_url(first)}); "
                "run the same `canvasq submit` again (or `canvasq reconcile`) once the broker is back") from None
        store.mark_published(todo)
    existing_name = None if created.created else store.get_run(created.run_id).name
    if as_json:
        click.echo(json.dumps({"run_id": created.run_id, "created": created.created, "requests": created.requests,
                               "chunks": len(created.chunk_ids), "published": len(todo), "queue": run_queue,
                               "name": name or Path(file).name[:MAX_NAME] if created.created else existing_name,
                               "idempotency_key": idempotency_key}))
        return
    if created.created:
        click.echo(f"submitted {created.requests} requests in {len(created.chunk_ids)} chunks to {queue}", err=True)
    else:
        renamed = f" (named {existing_name!r}; --name {name!r} was not applied)" if name and name != existing_name else ""
        published = (f"published its {len(todo)} unpublished chunk(s)" if todo
                     else "nothing published (every chunk was published before)")
        click.echo(f"key {idempotency_key!r} already submitted as {created.run_id}: returned the existing run"
                   f"{renamed}; {published}. A different --key submits the file again as a new run", err=True)
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
    _check_model(settings)  # the child loads it: a missing or corrupt model fails here, not per chunk
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
    settings = _settings()
    store = _open_store(settings, upgrade_sqlite=False)
    run_row = _get_run(store, run_id)
    _reap_interrupted(store, settings)
    while True:
        s = store.run_summary(run_row.id)
        if as_json:
            click.echo(json.dumps(s, default=str))
        else:
            click.echo(_status_line(s))
        if not watch or s["status"] not in ("queued", "running", "cancelling"):
            if s["status"] == "interrupted":
                click.echo(f"{s['run_id']} was interrupted: the same `canvasq run` command continues it", err=True)
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
    settings = _settings()
    store = _open_store(settings, upgrade_sqlite=False)
    _reap_interrupted(store, settings)
    rows = store.list_runs(status_, limit)
    if as_json:
        click.echo(json.dumps(rows))
        return
    click.echo(_table(["run", "name", "status", "total", "done", "errored", "expired", "cancelled", "queued",
                       "decoder", "created"],
                      [[r["run_id"], r["name"], r["status"], r["total"], r["done"], r["errored"], r["expired"],
                        r["cancelled"], r["queued"], r["decoder"], r["created_at"]] for r in rows]))


@cli.command()
@click.argument("run_id", metavar="RUN")
@click.option("-o", "--output", "out_path", type=click.Path(dir_okay=False), default="-", show_default=True,
              help="Where to write OpenAI batch output lines.")
@click.option("--errors", "errors_path", type=click.Path(dir_okay=False), default=None,
              help="Write errored / expired / cancelled rows here instead of into OUTPUT.")
@click.option("--ordered", is_flag=True, help="In input-file order (default: completion order).")
@click.option("--json", "as_json", is_flag=True,
              help="Report counts and unfinished rows as one JSON line (on stderr when OUTPUT is stdout).")
def results(run_id, out_path, errors_path, ordered, as_json):
    """Export RUN's finished rows as OpenAI batch output lines.

    On a run that is not finished, only its finished rows are exported, and it says so: how many rows
    are missing and the first of their custom_ids.

    Example:

        canvasq results run_1a2b3c4d -o out.jsonl --errors err.jsonl --ordered
    """
    settings = _settings()
    store = _open_store(settings, upgrade_sqlite=False)
    run_row = _get_run(store, run_id)
    _reap_interrupted(store, settings)
    if errors_path is not None and out_path != "-" and os.path.realpath(errors_path) == os.path.realpath(out_path):
        raise click.BadParameter("is the same file as --output", param_hint="--errors")
    files, direct = [], []  # files: temporary files renamed into place when complete; direct: devices, pipes

    def open_target(path):
        if path is None:
            return None
        if path == "-":
            return sys.stdout
        if Path(path).exists() and not Path(path).is_file():  # /dev/stdout, a FIFO: written as it goes
            direct.append(open(path, "w", encoding="utf-8"))  # noqa: SIM115 - closed below
            return direct[-1]
        files.append(_Output(path))
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
    if as_json:
        c = store.counts(run_row.id)
        click.echo(json.dumps({"run_id": run_row.id, "status": store.run_status(run_row.id), "results": n_ok,
                               "errors": n_err, "unfinished": c["queued"], "total": c["total"],
                               "missing": store.missing_rows(run_row.id, MISSING_SHOWN)}), err=out_path == "-")
        return
    click.echo(f"{n_ok} results, {n_err} errors", err=True)
    _report_unfinished(store, run_row.id)


def _say(as_json: bool, text: str, **record) -> None:
    """A command's result: the sentence, or with --json the record as one JSON line."""
    click.echo(json.dumps(record, default=str) if as_json else text)


@cli.command()
@click.argument("run_id", metavar="RUN")
@json_option
def cancel(run_id, as_json):
    """Cancel RUN: chunks not started are cancelled now, running ones stop between decoder steps.
    Finished rows are kept.

    Example:

        canvasq cancel run_1a2b3c4d
    """
    settings = _settings()
    store = _open_store(settings, upgrade_sqlite=False)
    run_row = _get_run(store, run_id)
    # nobody holds an interrupted embedded run's chunks to see the flag: cancel their rows now
    orphaned = run_row.mode == "embedded" and not _owner_alive(store.embedded_owner(run_row.id), settings)
    status = store.cancel_run(run_row.id, close_running=orphaned)
    _say(as_json, f"{run_row.id}: {status}", run_id=run_row.id, status=status, counts=store.counts(run_row.id))


@cli.command()
@click.argument("run_id", metavar="RUN")
@click.option("--only", default="errored,expired", show_default=True,
              help="Comma-separated request states to re-run (errored, expired, cancelled), and/or stuck: "
                   "queued rows no live worker will finish (their worker stopped heartbeating).")
@json_option
def retry(run_id, only, as_json):
    """Re-run RUN's rows in the given states; finished rows stay, results merge.

    `stuck` re-publishes, in new chunks, the queued rows whose chunk is held by a worker without a
    recent heartbeat or under an expired lease (what `reconcile` would re-publish), or that a
    chunk left behind; rows a live worker holds or that wait in the queue are left alone.

    Example:

        canvasq retry run_1a2b3c4d --only errored
        canvasq retry run_1a2b3c4d --only stuck
    """
    from datetime import timedelta

    from canvasq.api.models import utcnow

    states = [s.strip() for s in only.split(",") if s.strip()]
    bad = [s for s in states if s not in ("errored", "expired", "cancelled", "stuck")]
    if bad or not states:
        raise click.BadParameter(f"unknown state(s) {bad}; use errored, expired, cancelled, stuck",
                                 param_hint="--only")
    settings = _settings()
    store = _open_store(settings, upgrade_sqlite=False)
    run_row = _get_run(store, run_id)
    embedded = run_row.mode == "embedded"
    if embedded:  # load the model before any row changes state
        _refuse_if_owned(store, settings, run_row.id)
        run_settings = settings.model_copy(update={"model": run_row.model})
        _check_model(run_settings)
        rt = _embedded_runtime(store, run_settings)
    else:
        _check_broker(settings)
    before = store.counts(run_row.id)
    offline_before = utcnow() - timedelta(seconds=settings.offline_after_s)
    stuck = len(store.stuck_rows(run_row.id, offline_before)) if "stuck" in states else 0
    n = sum(before[s] for s in states if s != "stuck") + stuck
    # the run's own chunk size (a run from before it was stored: the largest chunk it has)
    chunk_size = run_row.chunk_size or store.largest_chunk(run_row.id) or settings.chunk_size
    chunk_ids = store.retry_run(run_row.id, states, chunk_size, offline_before=offline_before)
    if not embedded:
        if not chunk_ids:
            waiting = f"; {before['queued']} queued rows are held by live workers or wait in the queue" \
                if "stuck" in states and before["queued"] else ""
            _say(as_json, f"{run_row.id}: no rows in {states}{waiting}", run_id=run_row.id, states=states,
                 rows=0, chunks=0, queued=before["queued"])
            return
        from canvasq.worker.celery_app import publish_chunks

        publish_chunks(chunk_ids, run_row.queue, settings)
        store.mark_published(chunk_ids)
        _say(as_json, f"{run_row.id}: re-queued {n} rows in {len(chunk_ids)} chunks of up to {chunk_size}",
             run_id=run_row.id, states=states, rows=n, chunks=len(chunk_ids), chunk_size=chunk_size)
        return
    left = store.counts(run_row.id)["queued"]  # the retried rows and any an interruption left queued
    if not left:
        _say(as_json, f"{run_row.id}: no rows in {states}", run_id=run_row.id, states=states, rows=0, chunks=0)
        return
    _process_embedded(rt, run_row.id)
    extra = f" and {left - n} left unfinished by an interruption" if left > n else ""
    _say(as_json, f"{run_row.id}: re-ran {n} rows in {states}{extra}", run_id=run_row.id, states=states, rows=n,
         left_by_interruption=max(0, left - n), counts=store.counts(run_row.id), status=store.run_status(run_row.id))
    _report_unfinished(store, run_row.id)


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
        raise click.ClickException(f"no trace for {custom_id!r} in {run_row.id}: {_why_no_trace(store, run_row.id, custom_id)}")
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
        state = store.row_state(run_row.id, custom_id)
        decoder = state[1].decoder if state and state[1] is not None else None
        plot_trace(recs, plot_path, title=f"{run_row.id} / {custom_id}  (decoder {decoder or '?'}, "
                                          f"{len(recs)} forwards, {sum(r['ms'] for r in recs):.0f} ms)")
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
        return (f"the row ended {status} ({out.error_code}: {(out.error_message or '')[:120]}) before any forward "
                "was stored")
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
        ax1.step(x, [r["own_rows"] or 0 for r in recs], where="mid", color="tab:orange", label="this request's rows")
    ax1.set_ylabel("rows in window")
    ax1.legend(loc="upper right")
    ax2.bar(x, [r["commits"] for r in recs], color="tab:green", label="commits τ (batch)")
    if any(r["own_commits"] is not None for r in recs):
        ax2.step(x, [r["own_commits"] or 0 for r in recs], where="mid", color="tab:orange",
                 label="this request's commits")
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


@cli.command()
@click.option("--loop", "loop_s", type=float, default=None, help="Repeat every LOOP seconds (a sidecar).")
def reconcile(loop_s):
    """Repair the queue from the store: publish chunks a crash left unpublished, re-publish chunks
    whose lease expired, expire runs past their deadline, finalise runs with no row left queued.

    Workers already run this every CANVASQ_RECONCILE_S seconds (15; one worker per interval across
    the fleet); run it by hand, or as a sidecar where workers run with CANVASQ_RECONCILE_S=0.

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
    """Registered workers: online or offline, the chunk each holds, last heartbeat, throughput (from
    output rows). A worker is offline when its last heartbeat is older than 3 × CANVASQ_HEARTBEAT_S
    + 10 s (55 s by default): it died, or lost the store. Online workers come first.

    Example:

        canvasq workers
    """
    settings = _settings()
    store = _open_store(settings, upgrade_sqlite=False)
    rows = store.worker_stats(settings.offline_after_s)
    rows.sort(key=lambda r: (not r["online"], r["last_seen_s"] if not r["online"] else 0, r["worker"]))
    if as_json:
        click.echo(json.dumps(rows))
        return
    click.echo(_table(["worker", "state", "chunk", "device", "model", "last seen", "requests", "tokens", "tok/s"],
                      [[r["worker"], "online" if r["online"] else "offline", r["chunk"] or "-", r["device"],
                        model_name(r["model"]), f"{_fmt_s(r['last_seen_s'])} ago", r["requests"], r["tokens"],
                        _tok_s(r["tok_s"])] for r in rows]))


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

    url = _database_url()
    upgrade(url, revision)
    click.echo(f"{mask_url(url)}: upgraded to {revision}")


@db.command("downgrade")
@click.argument("revision")
@click.option("--yes", is_flag=True, help="Do it without asking (a downgrade can drop tables and their rows).")
def db_downgrade(revision, yes):
    """Downgrade the schema to REVISION ("base" drops every table). Asks first unless --yes; without a
    terminal to ask on, refuses unless --yes.

    Example:

        canvasq db downgrade base --yes
    """
    from canvasq.api.store import downgrade

    url = _database_url()
    if not yes:
        what = "drops every table and every run, row and output in it" if revision == "base" else \
            "drops what later revisions added, and the data in it"
        if not sys.stdin.isatty():
            raise click.ClickException(f"downgrading {mask_url(url)} to {revision} {what}; pass --yes to do it")
        click.confirm(f"Downgrading {mask_url(url)} to {revision} {what}. Continue?", abort=True, err=True)
    downgrade(url, revision)
    click.echo(f"{mask_url(url)}: downgraded to {revision}")


@db.command("current")
def db_current():
    """Print the schema revision of the database and of the code.

    Example:

        canvasq db current
    """
    from canvasq.api.store import Store, current_revision, head_revision

    store = Store(_database_url())
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
    from canvasq.worker.runtime import resolve_device

    try:
        device = resolve_device(s.device)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    view["device"] = f"{s.device} (resolved: {device})"
    view["experts"] = f"{s.experts} (resolved: {resolve_experts(s.experts, device)})"
    for k, v in view.items():
        click.echo(f"{k} = {v}")
    from canvasq.decoders.routing import routing_table

    calibration, why = _calibration_for(s)
    click.echo(f"routing (--decoder auto, budget {s.routing_budget:g} points{why}):")
    for task, decoder, source in routing_table(s.routing, calibration, s.routing_budget):
        click.echo(f"  {task} -> {decoder}  [{source}]")


def _calibration_for(settings):
    """The newest stored calibration of the configured model, and a note when none could be read."""
    from canvasq.api.store import Store, database_problem
    from canvasq.decoders.calibration import load_for_model

    if database_problem(settings.database_url):
        return None, "; calibrations: database unusable"
    store = Store.from_settings(settings)
    try:
        return load_for_model(store, settings.model), ""
    except Exception as exc:  # noqa: BLE001 config prints what it can
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return None, f"; calibrations not readable: {mask_url(first)[:120]}"
    finally:
        store.dispose()


@cli.command()
@click.argument("model", metavar="MODEL")
@click.option("--device", default=None, metavar="auto|cpu|cuda|cuda:N",
              help="Where to pack (default: CANVASQ_DEVICE). A GPU packs in seconds per layer.")
@click.option("--cache-dir", default=None, type=click.Path(file_okay=False),
              help="Write the cache here (default: CANVASQ_W4_CACHE_DIR, else MODEL/canvasq_w4 when "
                   "writable, else ~/.cache/canvasq/w4).")
@click.option("--force", is_flag=True, help="Repack even when a cache for this checkpoint exists.")
def pack(model, device, cache_dir, force):
    """Pack MODEL's experts to W4A16 ahead of time and write the cache that workers read at start.

    With CANVASQ_EXPERTS=w4 (the default on CUDA) a worker packs a checkpoint at its first start
    and caches the packs; this does it before any worker starts. MODEL is a local HF directory.

    Example:

        canvasq pack /models/diffusiongemma
        CANVASQ_W4_CACHE_DIR=/scratch/w4 canvasq pack /models/diffusiongemma --device cuda:1
    """
    from canvasq.model.loading import pack_checkpoint, w4_cache_path
    from canvasq.worker.runtime import bind_cuda_device, resolve_device

    s = get_settings()
    if model.startswith("random:"):
        raise click.ClickException(f"{model}: random weights are packed at every start; nothing to cache")
    if not (Path(model) / "config.json").is_file():
        raise click.ClickException(f"no model at {model!r} (expected a HF directory with config.json)")
    try:
        dev = resolve_device(device or s.device)
    except ValueError as exc:
        msg = str(exc).replace("CANVASQ_DEVICE", "--device") if device else str(exc)
        raise click.ClickException(msg) from None
    import torch

    cache_dir = cache_dir or s.w4_cache_dir
    target = w4_cache_path(model, torch.bfloat16, cache_dir)
    if target.exists() and not force:
        click.echo(f"already packed: {target} ({target.stat().st_size / 2**30:.2f} GiB); --force repacks")
        return
    if force:
        target.unlink(missing_ok=True)
    bind_cuda_device(dev)
    t0 = time.perf_counter()
    path = pack_checkpoint(model, dev, torch.bfloat16, cache_dir)
    click.echo(f"packed {model} on {dev} in {time.perf_counter() - t0:.1f}s: {path} "
               f"({path.stat().st_size / 2**30:.2f} GiB)")


# ---------------------------------------------------------------------------------------- other rooms


def _register_optional() -> None:
    """Commands written in other rooms; their modules import only click at top level."""
    import importlib

    for module, attrs in (("canvasq.testbed.cli", ("eval_cmd", "testbed")), ("canvasq.decoders.cli", ("bench", "calibrate")),
                          ("canvasq.serve.cli", ("serve", "keys"))):
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
