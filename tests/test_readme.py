"""The README's two set-up commands are the ones CI and users run."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```\n(.*?)```", text, re.DOTALL)
    assert block, "README has no code block"
    return [line for line in block.group(1).splitlines() if line.strip()]


def test_readme_starts_with_exactly_two_setup_commands():
    text = (ROOT / "README.md").read_text()
    first_block = text.index("```")
    assert text.count("```", 0, first_block) == 0
    cmds = readme_commands()
    assert len(cmds) == 2, cmds
    install, tests = cmds
    assert "pip install" in install and "canvasq run examples/prompts.jsonl" in install
    assert "pytest" in tests


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert readme_commands()[1] in [line.strip() for line in ci]


def test_example_file_exists():
    assert (ROOT / "examples" / "prompts.jsonl").is_file()
