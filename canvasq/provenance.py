"""What code produced a figure: the commit every benchmark and bench report names."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path


def git_commit() -> str:
    """Short hash of HEAD; `CANVASQ_COMMIT` wins (the GPU machine gets a copy of the tree without
    .git); "unknown" when neither is available."""
    if os.environ.get("CANVASQ_COMMIT"):
        return os.environ["CANVASQ_COMMIT"]
    try:
        return (
            subprocess.check_output(
                ["git", "rev-parse", "--short", "HEAD"],
                cwd=Path(__file__).resolve().parent,
                text=True,
                stderr=subprocess.DEVNULL,
            ).strip()
            or "unknown"
        )
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
