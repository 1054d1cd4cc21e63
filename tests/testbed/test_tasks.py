import ast
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


# Fake passes: only the values the candidate computes decide, compared here in the parent.
FAKES = {
    "os._exit(0) before the checks": "    pass\nimport os\nos._exit(0)\n",
    "sys.exit(0) before the checks": "    pass\nimport sys\nsys.exit(0)\n",
    "sys.exit(0) inside the function": "    import sys\n    sys.exit(0)\n",
    "atexit forces exit code 0": "    return 0\nimport atexit, os\natexit.register(lambda: os._exit(0))\n",
    "object whose __eq__ is always true": (
        "    class Anything:\n        def __eq__(self, other):\n            return True\n"
        "        __hash__ = object.__hash__\n    return Anything()\n"
    ),
    "int subclass that equals everything": (
        "    class I(int):\n        def __eq__(self, other):\n            return True\n    return I(0)\n"
    ),
    "list subclass that equals everything": (
        "    class L(list):\n        def __eq__(self, other):\n            return True\n    return L()\n"
    ),
    "reads the hidden asserts from its own source": (
        "    import re, sys, gc\n"
        "    arg = list(locals().values())[0]\n"
        "    seen = open('/sandbox/main.py').read() + str(getattr(sys.modules['__main__'], '_src', ''))\n"
        "    seen += ''.join(o for o in gc.get_objects() if isinstance(o, str) and 'assert' in o)\n"
        "    for args, want in re.findall(r'assert \\w+\\((\\[.*?\\])\\) == (.+)', seen):\n"
        "        if eval(args) == arg:\n"
        "            return eval(want)\n"
        "    return None\n"
    ),
    "prints a success and writes forged data": (
        "    import os\n    print('All tests passed')\n    os.write(3, b'[[\"value\", \"0\"]]')\n    os._exit(0)\n"
    ),
}


@pytest.mark.parametrize("fake", list(FAKES))
def test_fake_passes_fail(fake):
    for p in tasks.generate("code", 6, seed=21):
        assert not tasks.verify(p, FAKES[fake]), (fake, p.uid)


def test_expected_values_never_enter_the_child():
    for p in tasks.generate("code", 20, seed=22):
        program = tasks._harness(p.prompt + p.answer, p.entry, [a for a, _ in tasks.code_cases(p)])
        assert "assert" not in program and "==" not in program.split("exec(compile(")[0]
        assert all(t not in program for t in p.tests)


def test_printing_and_partly_wrong_bodies():
    p = tasks.generate("code", 1, seed=23)[0]
    noisy = p.answer.replace("\n", "\n    print('debug', file=__import__('sys').stderr)\n", 1)
    assert tasks.verify(p, noisy)  # printed text decides nothing either way
    first = ast.literal_eval(tasks.code_cases(p)[0][0])[0]
    raises_once = f"    if list(locals().values())[0] == {first!r}:\n        raise ValueError\n"
    assert tasks.verify(p, "    pass\n" + p.answer)
    assert not tasks.verify(p, raises_once + p.answer)


def test_code_task_refuses_without_a_sandbox(monkeypatch):
    from canvasq.testbed import sandbox

    monkeypatch.setattr(sandbox, "unavailable_reason", lambda: "no isolation here")
    p = tasks.generate("code", 1, seed=24)[0]
    with pytest.raises(sandbox.SandboxUnavailable, match="no isolation here"):
        tasks.verify(p, p.answer)
