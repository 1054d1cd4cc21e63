"""`canvasq serve` and `canvasq keys` (registered on the `canvasq` group by canvasq.cli). Only
click is imported at top level: FastAPI, uvicorn and the store load inside the commands."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import click


def _store():
    from canvasq.cli.common import cli_settings, open_store

    return open_store(cli_settings())


@click.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=int, default=8000, show_default=True)
@click.option(
    "--with-worker",
    is_flag=True,
    help="Also run a worker in a child process that takes this server's batches from SQL (no broker).",
)
@click.option(
    "--model",
    "model",
    default=None,
    metavar="PATH|random:26b-a4b",
    help="Model spec (default: $CANVASQ_MODEL, else the repo's models/testbed).",
)
@click.option("--log-level", default="info", show_default=True)
def serve(host, port, with_worker, model, log_level):
    """Serve OpenAI's Files and Batches API (`/v1/files`, `/v1/batches`) over the store and queue.

    Batches become runs on the model's queue, served by `canvasq worker` processes; with
    --with-worker one child worker serves them instead, with no broker (SQLite by default: the
    whole flow on one machine). Requests need `Authorization: Bearer <key>` (`canvasq keys create`).
    Files live in CANVASQ_FILES_DIR (default ./canvasq-files); uploads are limited by
    CANVASQ_MAX_UPLOAD_BYTES and CANVASQ_MAX_UPLOAD_LINES.

    Example:

    \b
        canvasq keys create --project demo         # prints the key once
        canvasq serve --with-worker --port 8000
        # OpenAI(base_url="http://127.0.0.1:8000/v1", api_key=KEY).batches.create(...)
    """
    import uvicorn

    from canvasq.cli.common import check_broker, check_model, cli_settings
    from canvasq.serve.app import create_app
    from canvasq.serve.local_worker import local_queue

    if model:
        os.environ["CANVASQ_MODEL"] = model
    settings = cli_settings(model)
    check_model(settings)
    store = _store()
    child = None
    if with_worker:
        queue = local_queue(settings)
        child = _ChildWorker(queue)
        # uvicorn re-raises SIGTERM after its shutdown, so `finally` below may not run: stop it there
        app = create_app(
            store, settings=settings, publish=lambda _ids, _q: None, queue=queue, on_shutdown=(child.stop,)
        )
        child.start()
    else:
        check_broker(settings)
        app = create_app(store, settings=settings)
    click.echo(
        f"canvasq serve on http://{host}:{port}/v1 (model {settings.model}"
        f"{', with a local worker' if with_worker else ', queue ' + settings.queue_for()})",
        err=True,
    )
    try:
        uvicorn.run(app, host=host, port=port, log_level=log_level)
    finally:
        if child is not None:
            child.stop()
        store.dispose()


class _ChildWorker:
    """`python -m canvasq.serve.local_worker QUEUE`, restarted when it dies (after a pause)."""

    def __init__(self, queue: str):
        self.queue = queue
        self.proc: subprocess.Popen | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="canvasq-local-worker", daemon=True)

    def _spawn(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "canvasq.serve.local_worker", self.queue])

    def start(self) -> None:
        self._spawn()
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(1.0):
            if self.proc is not None and self.proc.poll() is not None:
                click.echo(f"local worker exited ({self.proc.returncode}); restarting it", err=True)
                time.sleep(2.0)
                if not self._stop.is_set():
                    self._spawn()

    def stop(self) -> None:
        self._stop.set()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


@click.group()
def keys():
    """Create, list and revoke API keys for `canvasq serve` (stored hashed; shown once).

    Example:

    \b
        canvasq keys create --project research --name alice
        canvasq keys list
        canvasq keys revoke key_0123abcd
    """


@keys.command("create")
@click.option("--project", required=True, help="The project whose files and batches the key owns and sees.")
@click.option("--name", default=None, help="A label for the key.")
def keys_create(project, name):
    """Create a key and print it (the only time it is shown); its id goes to stderr.

    Example:

    \b
        export OPENAI_API_KEY=$(canvasq keys create --project research)
    """
    from canvasq.serve.keys import create_key

    if not project.strip() or len(project) > 200 or (name and len(name) > 200):
        raise click.BadParameter("a project is 1 to 200 characters, a name at most 200")
    store = _store()
    key_id, token = create_key(store, project, name)
    click.echo(f"created {key_id} for project {project!r}; the key is printed once, on stdout", err=True)
    click.echo(token)


@keys.command("list")
@click.option("--all", "show_all", is_flag=True, help="Include revoked keys.")
def keys_list(show_all):
    """List keys (id, project, name, prefix, created, revoked); never the keys themselves.

    Example:

    \b
        canvasq keys list --all
    """
    from canvasq.cli.common import table
    from canvasq.serve.keys import list_keys

    rows = list_keys(_store(), include_revoked=show_all)
    click.echo(
        table(
            ["id", "project", "name", "prefix", "created", "revoked"],
            [
                [
                    k.id,
                    k.project,
                    k.name,
                    k.prefix + "...",
                    k.created_at.isoformat(timespec="seconds"),
                    k.revoked_at.isoformat(timespec="seconds") if k.revoked_at else None,
                ]
                for k in rows
            ],
        )
    )


@keys.command("revoke")
@click.argument("key_id")
def keys_revoke(key_id):
    """Revoke KEY_ID: requests with it get 401 from then on.

    Example:

    \b
        canvasq keys revoke key_0123abcd
    """
    from canvasq.serve.keys import revoke_key

    if not revoke_key(_store(), key_id):
        raise click.ClickException(f"no live key {key_id!r}")
    click.echo(f"revoked {key_id}", err=True)
