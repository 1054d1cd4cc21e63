"""Commands about the installation: `db`, `config`, `pack`."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import click

from canvasq.cli.common import checked_database_url
from canvasq.core.settings import get_settings, mask_url, resolve_experts


@click.group()
def db():
    """Database schema (Alembic).

    Example:

    \b
        CANVASQ_DATABASE_URL=postgresql+psycopg://canvasq@db/canvasq canvasq db upgrade
    """


@db.command("upgrade")
@click.option("--revision", default="head", show_default=True)
def db_upgrade(revision):
    """Upgrade the schema of $CANVASQ_DATABASE_URL to REVISION.

    Example:

    \b
        canvasq db upgrade
    """
    from canvasq.core.db import upgrade

    url = checked_database_url()
    upgrade(url, revision)
    click.echo(f"{mask_url(url)}: upgraded to {revision}")


@db.command("downgrade")
@click.argument("revision")
@click.option(
    "--yes", is_flag=True, help="Do it without asking (a downgrade can drop tables and their rows)."
)
def db_downgrade(revision, yes):
    """Downgrade the schema to REVISION ("base" drops every table). Asks first unless --yes; without a
    terminal to ask on, refuses unless --yes.

    Example:

    \b
        canvasq db downgrade base --yes
    """
    from canvasq.core.db import downgrade

    url = checked_database_url()
    if not yes:
        what = (
            "drops every table and every run, row and output in it"
            if revision == "base"
            else "drops what later revisions added, and the data in it"
        )
        if not sys.stdin.isatty():
            raise click.ClickException(
                f"downgrading {mask_url(url)} to {revision} {what}; pass --yes to do it"
            )
        click.confirm(f"Downgrading {mask_url(url)} to {revision} {what}. Continue?", abort=True, err=True)
    downgrade(url, revision)
    click.echo(f"{mask_url(url)}: downgraded to {revision}")


@db.command("current")
def db_current():
    """Print the schema revision of the database and of the code.

    Example:

    \b
        canvasq db current
    """
    from canvasq.core.db import current_revision, head_revision
    from canvasq.core.store import Store

    store = Store(checked_database_url())
    click.echo(
        f"{mask_url(store.url)}: {current_revision(store.engine) or 'empty'} (code: {head_revision()})"
    )


@click.command("config")
def config_cmd():
    """Print the effective settings (passwords masked).

    Example:

    \b
        CANVASQ_DATABASE_URL=postgresql+psycopg://u:secret@h/db canvasq config
    """
    s = get_settings()
    view = s.model_dump()
    view.update(s.describe())
    from canvasq.worker.devices import resolve_device

    try:
        device = resolve_device(s.device)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    view["device"] = f"{s.device} (resolved: {device})"
    view["experts"] = f"{s.experts} (resolved: {resolve_experts(s.experts, device)})"
    view["fp8"] = f"{s.fp8} (resolved: {_resolve_fp8(s.fp8, device)})"
    for k, v in view.items():
        click.echo(f"{k} = {v}")
    from canvasq.decoders.routing import routing_table

    calibration, why = _calibration_for(s)
    click.echo(f"routing (--decoder auto, budget {s.routing_budget:g} points{why}):")
    for task, decoder, source in routing_table(s.routing, calibration, s.routing_budget):
        click.echo(f"  {task} -> {decoder}  [{source}]")


def _calibration_for(settings):
    """The newest stored calibration of the configured model, and a note when none could be read."""
    from canvasq.core.calibrations import load_for_model
    from canvasq.core.db import database_problem
    from canvasq.core.store import Store

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


@click.command()
@click.argument("model", metavar="MODEL")
@click.option(
    "--device",
    default=None,
    metavar="auto|cpu|cuda|cuda:N",
    help="Where to pack (default: CANVASQ_DEVICE). A GPU packs in seconds per layer.",
)
@click.option(
    "--cache-dir",
    default=None,
    type=click.Path(file_okay=False),
    help="Write the cache here (default: CANVASQ_W4_CACHE_DIR, else MODEL/canvasq_w4 when "
    "writable, else ~/.cache/canvasq/w4).",
)
@click.option("--force", is_flag=True, help="Repack even when a cache for this checkpoint exists.")
def pack(model, device, cache_dir, force):
    """Pack MODEL's experts to W4A16 ahead of time and write the cache that workers read at start.

    With CANVASQ_EXPERTS=w4 (the default on CUDA) a worker packs a checkpoint at its first start
    and caches the packs; this does it before any worker starts. MODEL is a local HF directory.

    Example:

    \b
        canvasq pack /models/diffusiongemma
        CANVASQ_W4_CACHE_DIR=/scratch/w4 canvasq pack /models/diffusiongemma --device cuda:1
    """
    from canvasq.model.loading import pack_checkpoint, w4_cache_path
    from canvasq.worker.devices import bind_cuda_device, resolve_device

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
    click.echo(
        f"packed {model} on {dev} in {time.perf_counter() - t0:.1f}s: {path} "
        f"({path.stat().st_size / 2**30:.2f} GiB)"
    )


def _resolve_fp8(setting: str, device: str) -> str:
    """What CANVASQ_FP8 turns on for `device`: the parts, or off (torch only for a CUDA device)."""
    if not str(device).startswith("cuda"):
        return "off" if setting == "auto" else f"{setting} (the dequantising twin: slow, for tests)"
    from canvasq.model.fp8 import parse_parts

    try:
        return ",".join(parse_parts(setting, device)) or "off"
    except ValueError as exc:
        return f"error: {exc}"
