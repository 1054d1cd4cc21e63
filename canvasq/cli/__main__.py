"""`python -m canvasq.cli` is the `canvasq` command."""

from canvasq.cli import main

main()
