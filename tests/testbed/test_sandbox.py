import time

from canvasq.testbed.sandbox import run_python


def test_runs_plain_code():
    r = run_python("print(sum(range(10)))")
    assert r.ok and r.stdout.strip() == "45"


def test_kills_infinite_loop():
    t0 = time.monotonic()
    r = run_python("while True:\n    pass\n", timeout_s=1.5)
    assert not r.ok and (r.timed_out or r.returncode != 0)
    assert time.monotonic() - t0 < 30


def test_blocks_fork_bomb():
    r = run_python("import os\nwhile True:\n    os.fork()\n", timeout_s=3)
    assert not r.ok
    assert "not allowed" in r.stderr or r.timed_out


def test_large_allocation_fails():
    r = run_python("x = bytearray(4 * 1024 ** 3)\nprint('allocated')\n", timeout_s=5)
    assert not r.ok
    assert "allocated" not in r.stdout
    assert "MemoryError" in r.stderr


def test_network_is_refused():
    r = run_python(
        "import socket\ns = socket.socket()\ns.connect(('127.0.0.1', 6379))\nprint('connected')\n", timeout_s=5
    )
    assert not r.ok and "connected" not in r.stdout
    assert "not allowed" in r.stderr


def test_subprocess_is_refused():
    r = run_python("import subprocess\nsubprocess.run(['echo', 'hi'])\n")
    assert not r.ok and "not allowed" in r.stderr


def test_environment_is_minimal(monkeypatch):
    monkeypatch.setenv("CANVASQ_SECRET_TOKEN", "hunter2")
    r = run_python("import os\nprint(sorted(os.environ))\n")
    assert r.ok and "CANVASQ_SECRET_TOKEN" not in r.stdout


def test_file_size_is_capped():
    r = run_python("open('big', 'wb').write(b'x' * (8 * 1024 * 1024))\n")
    assert not r.ok
