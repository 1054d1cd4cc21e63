"""What every `canvasq` command shares: option decorators, settings, the store opened with one-line
failures, atomic output files, and the table / progress formatting of reports."""

from __future__ import annotations

import glob
import json
import os
from pathlib import Path

import click

from canvasq.core.settings import DECODERS, get_settings, mask_url, model_name
from canvasq.core.statuses import RunStatus

RUN_STATUS_CHOICES = tuple(s.value for s in RunStatus)
MAX_NAME = 200  # the store's name / queue / key columns


def decoder_option(f):
    return click.option(
        "--decoder",
        type=click.Choice(DECODERS),
        default="auto",
        show_default=True,
        help="Decoding algorithm; auto = official (the accurate sampler) unless CANVASQ_ROUTING names a decoder for the task; hf = HF generate() (reference).",
    )(f)


def model_option(f):
    return click.option(
        "--model",
        "model",
        default=None,
        metavar="PATH|random:26b-a4b",
        help="Model spec (default: $CANVASQ_MODEL, else the repo's models/testbed).",
    )(f)


def json_option(f):
    return click.option("--json", "as_json", is_flag=True, help="Print one JSON line instead of a table.")(f)


def failure_line(exc: Exception) -> str | None:
    from canvasq.core.schemas import InputError
    from canvasq.core.settings import settings_error_line

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


def cli_settings(model: str | None = None):
    s = get_settings()
    if model and len(model) > 500:
        raise click.BadParameter("the model spec is longer than 500 characters", param_hint="--model")
    return s.model_copy(update={"model": model}) if model else s


def check_name(_ctx, param, value):
    if value is not None and len(value) > MAX_NAME:
        raise click.BadParameter(f"{len(value)} characters; the limit is {MAX_NAME}")
    return value


def check_model(settings) -> None:
    from canvasq.core.models import model_problem

    problem = model_problem(settings.model)
    if problem:
        raise click.ClickException(f"{problem} (CANVASQ_MODEL / --model)")


def check_broker(settings) -> None:
    """Connect to the broker once, so a down or misspelt broker fails before anything is stored."""
    from kombu import Connection

    try:
        with Connection(settings.broker_url, connect_timeout=5) as conn:
            conn.ensure_connection(max_retries=1, interval_start=0, timeout=10)
    except Exception as exc:  # noqa: BLE001 - any failure to connect is the same message
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise click.ClickException(
            f"cannot reach the broker CANVASQ_BROKER_URL={mask_url(settings.broker_url)}: {mask_url(first)}"
        ) from None


def open_store(settings, *, upgrade_sqlite: bool = True):
    """The store; a SQLite database is created / upgraded on first use, a server database must be
    upgraded explicitly (`canvasq db upgrade`, the compose file's one-shot migration)."""
    from sqlalchemy.exc import SQLAlchemyError

    from canvasq.core.db import SchemaOutOfDate, database_problem
    from canvasq.core.store import Store

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
        raise click.ClickException(
            f"cannot use the database CANVASQ_DATABASE_URL={mask_url(store.url)}: {mask_url(first)}"
        ) from None
    return store


def checked_database_url() -> str:
    from canvasq.core.db import database_problem

    url = get_settings().database_url
    problem = database_problem(url)
    if problem:
        raise click.ClickException(problem)
    return url


class AtomicOutput:
    """An output file written whole or not at all: a temporary file beside the target, renamed over
    it by `commit`. Opened before any generation, so a missing directory, a device (`/dev/full`), a
    read-only place or the input file itself fails at once and the old file stays as it was."""

    def __init__(self, path: str, input_path: str | None = None):
        import tempfile

        target = (
            Path(os.path.realpath(path)) if Path(path).is_symlink() else Path(path)
        )  # write through links
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
            pid = stale.name[len(prefix) :].split(".", 1)[0]
            if pid.isdigit() and int(pid) != os.getpid() and not pid_exists(int(pid)):
                stale.unlink(missing_ok=True)

    def commit(self) -> None:
        try:
            self.fh.flush()
            os.fsync(self.fh.fileno())
            self.fh.close()
            mode = self.path.stat().st_mode & 0o777 if self.path.exists() else 0o666 & ~current_umask()
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


def pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def get_run(store, run_id: str):
    run = store.get_run(run_id)
    if run is None:
        raise click.ClickException(f"no run {run_id!r} in {mask_url(store.url)}")
    return run


def validate_input(path: str, settings):
    from canvasq.core.schemas import Limits, validate_file

    limits = Limits.for_model(settings)
    report = validate_file(path, limits)
    if not report.ok:
        click.echo(report.summary(), err=True)
        raise SystemExit(2)
    return limits, report


def fmt_s(x: float | None) -> str:
    if x is None:
        return "-"
    x = int(x)
    return f"{x // 3600}:{x % 3600 // 60:02d}:{x % 60:02d}" if x >= 3600 else f"{x // 60}:{x % 60:02d}"


def table(headers: list[str], rows: list[list]) -> str:
    cells = [[str(h) for h in headers]] + [["-" if c is None else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = [
        "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def fmt_tok_s(x) -> str | None:
    return f"{x:,.1f}" if x else None


def per_req(forwards: int, requests: int) -> str | None:
    return f"{forwards / requests:.1f}" if requests else None


def slot_use(occupancy: list[tuple[int, int]]) -> dict | None:
    """Decode slot use over a run's steps: mean share busy, and for how much of the run all were."""
    if not occupancy:
        return None
    steps = len(occupancy)
    first_short = next((i for i, (n, k) in enumerate(occupancy) if n < k), steps)
    return {
        "slots": max(k for _, k in occupancy),
        "steps": steps,
        "mean": sum(n for n, _ in occupancy) / sum(k for _, k in occupancy),
        "full_until": first_short / steps,
    }


def summary_table(summary: dict) -> str:
    """fwd/req: model passes that served a request, averaged over requests (a pass shared by a batch
    counts for each request it served, as in `canvasq bench`); tok/fwd: tokens per such pass."""
    rows = [
        [
            d["decoder"],
            d["requests"],
            d["tokens"],
            per_req(d["forwards"], d["requests"]),
            f"{d['tokens'] / d['forwards']:.2f}" if d["forwards"] else None,
            f"{d['gen_s']:.1f}",
            fmt_tok_s(d["tok_s"]),
        ]
        for d in summary["decoders"]
    ]
    c = summary["counts"]
    done = sum(d["requests"] for d in summary["decoders"])
    gen_s = sum(d["gen_s"] for d in summary["decoders"])
    rows.append(
        [
            "total",
            done,
            summary["completion_tokens"],
            per_req(summary["forwards"], done),
            f"{summary['completion_tokens'] / summary['forwards']:.2f}" if summary["forwards"] else None,
            f"{gen_s:.1f}",
            fmt_tok_s(summary["completion_tokens"] / gen_s if gen_s else None),
        ]
    )
    head = (
        f"run {summary['run_id']}  status {summary['status']}  model {model_name(summary['model'])}  "
        f"requests {c['total']} (done {c['done']}, errored {c['errored']}, expired {c['expired']}, "
        f"cancelled {c['cancelled']}, queued {c['queued']})  wall {fmt_s(summary['wall_s'])}"
    )
    return (
        head + "\n" + table(["decoder", "requests", "tokens", "fwd/req", "tok/fwd", "gen s", "tok/s"], rows)
    )


def status_line(s: dict) -> str:
    """One progress line from `Store.run_summary`. The bar: `#` generated (done or errored), `x` not
    generated (cancelled or expired), `>` in flight (rows a worker holds), `-` waiting; the count is
    the generated rows, so a cancelled run never shows a full bar."""
    c, width = s["counts"], 30
    total = c["total"] or 1
    gen, closed = c["done"] + c["errored"], c["cancelled"] + c["expired"]
    cells = [
        int(width * gen / total),
        int(width * (gen + closed) / total),
        int(width * (gen + closed + s.get("in_flight", 0)) / total),
    ]
    bar = (
        "#" * cells[0] + "x" * (cells[1] - cells[0]) + ">" * (cells[2] - cells[1]) + "-" * (width - cells[2])
    )
    return (
        f"{s['run_id']} [{bar}] {gen}/{c['total']} generated  {s['status']}  done {c['done']} errored "
        f"{c['errored']} expired {c['expired']} cancelled {c['cancelled']} queued {c['queued']} "
        f"(in flight {s.get('in_flight', 0)})  tokens {s['completion_tokens']}  "
        f"tok/s {fmt_tok_s(s['tok_s']) or '-'}  ETA {fmt_s(s['eta_s'])}"
    )


MISSING_SHOWN = 20  # custom_ids of unfinished rows named in a report


def report_unfinished(store, run_id: str) -> None:
    """Rows not in the output because they are not terminal: always said, and named, never a silent gap."""
    c = store.counts(run_id)
    if c["queued"]:
        missing = store.missing_rows(run_id, MISSING_SHOWN)
        more = f" and {c['queued'] - len(missing)} more" if c["queued"] > len(missing) else ""
        click.echo(
            f"{c['queued']} of {c['total']} rows of {run_id} are not finished ({store.run_status(run_id)}) "
            f"and are not in the output: {', '.join(missing)}{more}",
            err=True,
        )


def say(as_json: bool, text: str, **record) -> None:
    """A command's result: the sentence, or with --json the record as one JSON line."""
    click.echo(json.dumps(record, default=str) if as_json else text)
