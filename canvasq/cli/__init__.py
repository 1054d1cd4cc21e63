"""`canvasq`: one click group for submitting, running, watching and exporting generation runs.

Heavy imports (torch, transformers, the decoders) happen only inside the commands that generate
(`run`, `worker`'s child, `retry` of an embedded run); `canvasq --help` imports click, pydantic and
nothing else heavy. Settings come from `CANVASQ_*` variables (see `canvasq.core.settings`).

Modules: common (options, settings, store, output files, formatting), embedded (`run`), queue
(`submit`, `worker`, `cancel`, `retry`, `reconcile`), reports (`status`, `runs`, `results`, `trace`,
`workers`), admin (`db`, `config`, `pack`), bench (`bench`, `calibrate`), serve (`serve`, `keys`);
`eval` and `testbed` come from `canvasq.testbed.cli`. This room is the top floor: nothing imports it
(docs/CONTRACTS.md, "Floors").
"""

from __future__ import annotations

import os
import sys

import click

from canvasq.cli import adapt, admin, bench, embedded, queue, reports, serve
from canvasq.cli.common import failure_line
from canvasq.testbed import cli as testbed_cli


class _Group(click.Group):
    """Known failures (settings, database, broker, file system) end as one line and exit 1, never a
    traceback; anything else is a bug and keeps its traceback."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except (click.exceptions.ClickException, click.exceptions.Exit, click.exceptions.Abort, SystemExit):
            raise
        except Exception as exc:
            line = failure_line(exc)
            if line is None:
                raise
            raise click.ClickException(line) from None


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(package_name="canvasq")
def cli():
    """canvasq: batch generation with DiffusionGemma on a fleet of workers fed through Redis.

    Settings come from the environment: CANVASQ_DATABASE_URL (default SQLite ./canvasq.sqlite),
    CANVASQ_BROKER_URL (default redis://localhost:6379/0), CANVASQ_MODEL (default models/testbed).

    Example:

    \b
        canvasq run examples/prompts.jsonl -o results.jsonl
    """


for _cmd in (
    embedded.run,
    queue.submit,
    queue.worker,
    queue.cancel,
    queue.retry,
    queue.reconcile,
    reports.status,
    reports.runs,
    reports.results,
    reports.trace,
    reports.workers,
    admin.db,
    admin.config_cmd,
    admin.pack,
    bench.bench,
    bench.calibrate,
    adapt.adapt_cmd,
    serve.serve,
    serve.keys,
    testbed_cli.testbed,
):
    cli.add_command(_cmd)
cli.add_command(testbed_cli.eval_cmd, name="eval")


def main() -> None:
    """The `canvasq` process: `cli` with one exit path of its own. A run stopped by Ctrl-C or SIGTERM
    has committed its state (rows stored, chunks released, run `interrupted`) before it exits 130, so
    the process ends there without interpreter and native teardown, which nothing needs by then and
    which, rarely, aborts the process (SIGABRT, "terminate called without an active exception") after
    the interrupt was handled, turning a clean stop into a crash. Tests drive `cli` in-process and
    never reach this."""
    try:
        cli()
    except SystemExit as exc:
        if exc.code != 130:
            raise
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130)
