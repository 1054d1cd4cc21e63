"""Run model-written Python where it can do little harm.

The child is a fresh `python3 -I -S` (isolated: no user site, no env-driven imports) started with:
- a wall-clock timeout and an RLIMIT_CPU cap (infinite loops);
- RLIMIT_AS (large allocations fail with MemoryError), RLIMIT_FSIZE (no large files),
  RLIMIT_NOFILE, and RLIMIT_NPROC after dropping to `nobody` when started as root (fork bombs);
  (where the interpreter is readable by nobody; the audit hook below refuses fork either way);
- a temporary working directory, removed afterwards, and an environment of PATH/LANG only;
- an audit hook installed before the program runs that refuses sockets, subprocesses, fork and
  exec (no network, no escaping the rlimits through a helper process).
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import tempfile
from dataclasses import dataclass

_GUARD = r'''
import sys
_DENY = ("socket.", "subprocess.", "os.fork", "os.forkpty", "os.exec", "os.posix_spawn",
         "os.spawn", "os.system", "os.kill", "pty.spawn", "ctypes.")
def _hook(event, args):
    if event.startswith(_DENY):
        raise PermissionError(f"sandbox: {event} is not allowed")
sys.addaudithook(_hook)
del _hook
_src = sys.stdin.read()
exec(compile(_src, "<program>", "exec"), {"__name__": "__main__"})
'''


@dataclass
class SandboxResult:
    ok: bool
    returncode: int | None
    stdout: str
    stderr: str
    timed_out: bool


def _others_can_exec(path: str) -> bool:
    """Whether an unprivileged user can run `path` (every directory on the way searchable)."""
    path = os.path.realpath(path)
    parts = path.split(os.sep)
    for i in range(2, len(parts) + 1):
        mode = os.stat(os.sep.join(parts[:i]) or os.sep).st_mode
        if not mode & 0o001:
            return False
    return True


_DROP_TO_NOBODY = os.getuid() == 0 and _others_can_exec(sys.executable)


def _limits(cpu_s: int, mem_bytes: int, file_bytes: int) -> None:
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
    resource.setrlimit(resource.RLIMIT_AS, (mem_bytes, mem_bytes))
    resource.setrlimit(resource.RLIMIT_FSIZE, (file_bytes, file_bytes))
    resource.setrlimit(resource.RLIMIT_NOFILE, (32, 32))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    os.setsid()
    if _DROP_TO_NOBODY:  # root ignores RLIMIT_NPROC: run as nobody where the interpreter allows
        os.setgid(65534)
        os.setuid(65534)
    resource.setrlimit(resource.RLIMIT_NPROC, (16, 16))


def run_python(
    code: str,
    timeout_s: float = 5.0,
    mem_bytes: int = 512 * 1024 * 1024,
    file_bytes: int = 1024 * 1024,
) -> SandboxResult:
    cpu_s = max(1, int(timeout_s) + 1)
    with tempfile.TemporaryDirectory(prefix="canvasq-sbx-") as tmp:
        os.chmod(tmp, 0o777)
        try:
            proc = subprocess.run(
                [sys.executable, "-I", "-S", "-c", _GUARD],
                input=code,
                capture_output=True,
                text=True,
                timeout=timeout_s,
                cwd=tmp,
                env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
                preexec_fn=lambda: _limits(cpu_s, mem_bytes, file_bytes),
                check=False,  # a failing program is a result, not an error
            )
        except subprocess.TimeoutExpired as exc:
            return SandboxResult(False, None, _text(exc.stdout), _text(exc.stderr), True)
    return SandboxResult(proc.returncode == 0, proc.returncode, proc.stdout[-4000:], proc.stderr[-4000:], False)


def _text(data) -> str:
    if data is None:
        return ""
    return data.decode(errors="replace") if isinstance(data, bytes) else data
