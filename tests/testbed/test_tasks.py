import re

import pytest

from canvasq.testbed import tasks


@pytest.mark.parametrize("task", tasks.TASKS)
def test_generators_are_deterministic_per_seed(task):
    a = tasks.generate(task, 50, seed=3)
    b = tasks.generate(task, 50, seed=3)
    c = tasks.generate(task, 50, seed=4)
    assert a == b
    assert [p.prompt for p in a] != [p.prompt for p in c]


@pytest.mark.parametrize("task", tasks.TASKS)
def test_reference_answers_verify(task):
    for p in tasks.generate(task, 40, seed=11):
        assert tasks.verify(p, p.answer), p


def test_arith_rejects_wrong_final_answer():
    for p in tasks.generate("arith", 30, seed=5):
        wrong = re.sub(r"#### (\d+)", lambda m: f"#### {int(m.group(1)) + 1}", p.answer)
        assert not tasks.verify(p, wrong)
        assert not tasks.verify(p, "no final line")


def test_arith_worked_steps_are_correct_arithmetic():
    """Every `a op b (op c) = r` in the reference work holds, so the model learns true facts."""
    pat = re.compile(r"(\d+) ([+*-]) (\d+)(?: ([+-]) (\d+))? = (\d+)")
    for p in tasks.generate("arith", 300, seed=9):
        for m in pat.finditer(p.answer):
            a, op1, b, op2, c, r = m.groups()
            v = {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op1]
            if op2:
                v = v + int(c) if op2 == "+" else v - int(c)
            assert v == int(r), (m.group(0), p.answer)


def test_code_rejects_wrong_bodies():
    problems = tasks.generate("code", 30, seed=6)
    for p in problems:
        assert not tasks.verify(p, "    return 0\n")
        assert not tasks.verify(p, "    return []\n")
    for p in problems[:3]:  # each waits out its timeout
        assert not tasks.verify(p, "    while True:\n        pass\n", timeout_s=1.0)


def test_problem_space_is_large():
    """Distinct problems among 5,000 draws: collisions would show a small space."""
    for task in tasks.TASKS:
        prompts = {p.prompt for p in tasks.generate(task, 5000, seed=1)}
        assert len(prompts) >= 4990


def test_unknown_task_is_rejected():
    with pytest.raises(ValueError, match="unknown task"):
        tasks.generate("poetry", 1, 0)
