"""Docs are tested: every command has help with an Example block, and `canvasq --help` is light
(no torch / transformers / Celery import)."""

from __future__ import annotations

import subprocess
import sys

import click
import pytest
from click.testing import CliRunner

from canvasq.cli import cli


def _commands(group: click.Group, prefix: tuple[str, ...] = ()):
    for name, cmd in sorted(group.commands.items()):
        yield (*prefix, name), cmd
        if isinstance(cmd, click.Group):
            yield from _commands(cmd, (*prefix, name))


ALL = list(_commands(cli))
OURS = [
    (path, cmd)
    for path, cmd in ALL
    if cmd.callback is None or cmd.callback.__module__.startswith("canvasq.cli.")
]


def test_expected_commands_exist():
    names = {" ".join(p) for p, _ in ALL}
    for want in [
        "run",
        "submit",
        "worker",
        "status",
        "runs",
        "results",
        "cancel",
        "retry",
        "trace",
        "db upgrade",
        "reconcile",
    ]:
        assert want in names


@pytest.mark.parametrize("path, cmd", ALL, ids=[" ".join(p) for p, _ in ALL])
def test_every_command_has_help(path, cmd):
    assert cmd.help and cmd.help.strip(), f"{' '.join(path)} has no docstring"
    res = CliRunner().invoke(cli, [*path, "--help"])
    assert res.exit_code == 0, res.output
    assert "Usage:" in res.output


@pytest.mark.parametrize("path, cmd", OURS, ids=[" ".join(p) for p, _ in OURS])
def test_every_command_has_an_example(path, cmd):
    assert "Example:" in cmd.help, f"{' '.join(path)} lacks an Example block"
    example = cmd.help.split("Example:", 1)[1]
    assert "canvasq " + " ".join(path) in example, f"{' '.join(path)}'s example does not use it"


@pytest.mark.parametrize("path, cmd", ALL, ids=[" ".join(p) for p, _ in ALL])
def test_every_example_line_prints_as_written(path, cmd):
    """Click rewraps a paragraph of several lines into one unless a `\\b` line precedes it; an example
    block's commands must come out one per line, as written (copy-paste ready)."""
    want = [
        line.strip()
        for line in cmd.help.split("Example:", 1)[-1].splitlines()
        if line.strip().startswith("canvasq ")
    ]
    got = {
        line.strip()
        for line in CliRunner().invoke(cli, [*path, "--help"], terminal_width=200).output.splitlines()
    }
    assert [w for w in want if w not in got] == []


def test_help_does_not_import_heavy_modules():
    code = (
        "import sys\n"
        "from click.testing import CliRunner\n"
        "from canvasq.cli import cli\n"
        "r = CliRunner().invoke(cli, ['--help'])\n"
        "assert r.exit_code == 0, r.output\n"
        "for name in ['run', 'submit', 'worker', 'status', 'trace']:\n"
        "    assert CliRunner().invoke(cli, [name, '--help']).exit_code == 0\n"
        "heavy = [m for m in ('torch', 'transformers', 'celery', 'matplotlib', 'triton') if m in sys.modules]\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert out == "", f"--help imported {out}"
