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


def test_example_file_is_the_eval_split_draw_the_readme_names():
    """examples/prompts.jsonl is what scripts/example_prompts.py writes (eval split, seed 2026)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("example_prompts", ROOT / "scripts" / "example_prompts.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    want = "\n".join(script.lines()) + "\n"
    assert (ROOT / "examples" / "prompts.jsonl").read_text() == want, "run: python scripts/example_prompts.py"
    text = (ROOT / "README.md").read_text()
    assert 'generate("arith" | "code", 12, seed=2026)' in text and "scripts/example_prompts.py" in text


def test_ci_runs_the_gates_before_the_tests():
    """Lint, format and type gates start in CI before the README's test command (issue 33); one sent to
    the background (mypy, beside the tests) is waited for after them and fails the run."""
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    tests_at = ci.index(readme_commands()[1])
    for gate in ("ruff check", "ruff format --check", "mypy"):
        at = [i for i, line in enumerate(ci) if line.startswith("python3 -m " + gate)]
        assert at and at[0] < tests_at, gate
        if ci[at[0]].endswith("&"):
            waits = [i for i, line in enumerate(ci) if line.startswith("if ! wait ")]
            assert waits and waits[0] > tests_at and "exit 1" in ci[waits[0] : waits[0] + 4], gate
