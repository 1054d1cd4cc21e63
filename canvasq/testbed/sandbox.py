"""Run model-written Python where it can do little harm: the wall is the OS, not the interpreter.

    run_python (trusted parent) ──Popen──▶ launcher (root, host PID namespace; `_LAUNCHER`)
        │  bounded reads of stdout / stderr / fd 3           │ unshare(mount, net, PID, IPC, UTS); fork
        │  (the child's data channel) / status pipe           ▼
        │                                   init of the new PID namespace (root until exec):
        │                                     new root = read-only tmpfs holding read-only binds of
        │                                     /usr, /bin, /lib*, /etc/ld.so.cache, the interpreter's
        │                                     prefix, /dev/{null,zero,full,random,urandom}, and a
        │                                     size-capped writable tmpfs at /sandbox (the cwd);
        │                                     chroot; rlimits; setgroups([]) + setresgid/uid(65534);
        │                                     no_new_privs; fds 0-3 only; empty environment;
        │                                     exec python -I -S -B with an audit hook (second layer)
        └── status: setup errors, exit code, timeout  ◀── launcher kills the namespace's init on
                                                          timeout: the kernel then kills every
                                                          process left in it (detached ones too)

What that buys: no network (a fresh network namespace has only a downed loopback; path sockets of
the host are not in the new root), no host files beyond the system libraries and the interpreter
(nothing under /root, /home, /tmp, /work, /etc, /proc is there), nothing writable but /sandbox
(which vanishes with the namespace), no signals to or view of host processes, uid 65534 with no
capabilities and RLIMIT_NPROC, and output read only up to a bound. The audit hook inside the child
refuses sockets, subprocesses and fork too, but a program can switch it off; it only makes the
common refusal message clear.

Namespaces, mounts and chroot need root here. Where they cannot be had (not root, a kernel or
container that refuses them) `run_python` raises `SandboxUnavailable` with one line saying why; it
never runs the code unconfined.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import lru_cache

NOBODY = 65534  # present on every Linux system; owns nothing we care about

_GUARD = r"""
import sys
_DENY = ("socket.", "subprocess.", "os.fork", "os.forkpty", "os.exec", "os.posix_spawn",
         "os.spawn", "os.system", "os.kill", "pty.spawn", "ctypes.")
def _hook(event, args):
    if event.startswith(_DENY):
        raise PermissionError(f"sandbox: {event} is not allowed")
sys.addaudithook(_hook)
del _hook
with open("/sandbox/main.py", encoding="utf-8") as _f:
    _src = _f.read()
exec(compile(_src, "<program>", "exec"), {"__name__": "__main__"})
"""

# Runs as root: `python -I -S -c _LAUNCHER CONFIG_JSON`. Plain libc calls through ctypes (os.unshare
# only exists from Python 3.12). Any failure before exec is reported on the status fd and the
# program never runs.
_LAUNCHER = r'''
import ctypes, json, os, resource, select, signal, sys

cfg = json.loads(sys.argv[1])
status = cfg["status_fd"]
libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
CLONE = 0x00020000 | 0x04000000 | 0x08000000 | 0x20000000 | 0x40000000  # NS UTS IPC PID NET
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38

def report(**kw):
    os.write(status, (json.dumps(kw) + "\n").encode())

def fail(msg):
    report(setup_error=msg)
    os._exit(125)

def check(rc, what):
    if rc != 0:
        fail(f"{what}: {os.strerror(ctypes.get_errno())}")

def mount(src, dst, fstype, flags, data=None):
    enc = lambda s: None if s is None else s.encode()
    check(libc.mount(enc(src), enc(dst), enc(fstype), flags, enc(data)), f"mount {src or fstype} on {dst}")

def place(root, path):
    """Bind `path` read-only at the same place under `root` (symlinks are copied as symlinks)."""
    target = root + path
    os.makedirs(os.path.dirname(target), exist_ok=True)
    if os.path.islink(path):
        os.symlink(os.readlink(path), target)
        return
    if not os.path.exists(path):
        return
    if os.path.isdir(path):
        os.makedirs(target, exist_ok=True)
    else:
        open(target, "w").close()
    dev = path.startswith("/dev/")
    mount(path, target, None, MS_BIND)
    mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | (0 if dev else MS_NODEV))

def init():
    root = cfg["root"]
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing below leaks back to the host
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m")
    for path in cfg["ro_paths"]:
        place(root, path)
    os.makedirs(root + "/sandbox")
    mount("tmpfs", root + "/sandbox", "tmpfs", MS_NOSUID | MS_NODEV,
          f"mode=0700,size={cfg['disk_bytes']},uid={cfg['uid']},gid={cfg['uid']}")
    with open(cfg["program"], "rb") as src, open(root + "/sandbox/main.py", "wb") as dst:
        dst.write(src.read())
    mount(None, root, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, "mode=0755,size=1m")
    os.chroot(root)
    os.chdir("/sandbox")
    for name, value in cfg["rlimits"].items():
        resource.setrlimit(getattr(resource, name), (value, value))
    os.setgroups([])
    os.setresgid(cfg["uid"], cfg["uid"], cfg["uid"])
    os.setresuid(cfg["uid"], cfg["uid"], cfg["uid"])
    if os.getuid() != cfg["uid"] or os.geteuid() != cfg["uid"]:
        fail("could not drop to the sandbox uid")
    check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "pdeathsig")
    os.dup2(cfg["result_fd"], 3, inheritable=True)
    os.closerange(4, 1 << 16)
    os.execve(cfg["python"], [cfg["python"], "-I", "-S", "-B", "-c", cfg["guard"]],
              {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": "/sandbox", "TMPDIR": "/sandbox"})

check(libc.unshare(CLONE), "unshare")
pid = os.fork()
if pid == 0:
    try:
        init()
    except BaseException as exc:  # report every setup failure; never run the program unconfined
        fail(f"{type(exc).__name__}: {exc}")
    os._exit(125)
os.close(cfg["result_fd"])
pidfd = os.pidfd_open(pid)
ready, _, _ = select.select([pidfd], [], [], cfg["timeout"])
if not ready:
    os.kill(pid, signal.SIGKILL)  # init of the PID namespace: the kernel kills everything in it
_, st = os.waitpid(pid, 0)
report(returncode=os.waitstatus_to_exitcode(st), timed_out=not ready)
'''


class SandboxUnavailable(RuntimeError):
    """Isolation cannot be set up on this machine; the code was not run."""


@dataclass
class SandboxResult:
    ok: bool  # exit code 0 and no timeout; says nothing about correctness (see `result`)
    returncode: int | None
    stdout: str  # at most `output_bytes` of each stream, decoded with replacement
    stderr: str
    timed_out: bool
    result: bytes = b""  # what the program wrote to fd 3 (its data channel), up to `result_bytes`
    truncated: bool = False  # some stream or the data channel went past its bound


def _read_only_paths() -> list[str]:
    """System libraries plus the interpreter's own tree (which may sit where uid 65534 cannot go,
    e.g. /root/.pyenv): bound at the same paths so the interpreter finds its stdlib."""
    paths = ["/usr", "/bin", "/lib", "/lib64", "/lib32", "/libx32", "/etc/ld.so.cache"]
    paths += [f"/dev/{d}" for d in ("null", "zero", "full", "random", "urandom")]
    exe = os.path.realpath(sys.executable)
    for extra in (
        os.path.realpath(sys.base_prefix),
        os.path.realpath(sys.base_exec_prefix),
        os.path.dirname(exe),
    ):
        if not any(extra == p or extra.startswith(p + "/") for p in paths if not os.path.islink(p)):
            paths.append(extra)
    return paths


def run_python(
    code: str,
    timeout_s: float = 5.0,
    mem_bytes: int = 512 * 1024 * 1024,
    file_bytes: int = 1024 * 1024,
    disk_bytes: int = 8 * 1024 * 1024,
    output_bytes: int = 64 * 1024,
    result_bytes: int = 1024 * 1024,
) -> SandboxResult:
    """Run `code` as `__main__` in the sandbox. Raises `SandboxUnavailable` if isolation fails."""
    if min(timeout_s, mem_bytes, file_bytes, disk_bytes, output_bytes, result_bytes) <= 0:
        raise ValueError("run_python: every limit must be positive (tmpfs reads size=0 as unlimited)")
    reason = unavailable_reason()
    if reason:
        raise SandboxUnavailable(reason)
    return _run(code, timeout_s, mem_bytes, file_bytes, disk_bytes, output_bytes, result_bytes)


@lru_cache(maxsize=1)
def unavailable_reason() -> str | None:
    """None when the sandbox works here; else one line saying why code cannot be run safely."""
    if sys.platform != "linux":
        return "the code sandbox needs Linux namespaces; refusing to run model-written code"
    if os.geteuid() != 0:
        return (
            "the code sandbox needs root (mount/network/PID namespaces, chroot, a drop to uid "
            f"{NOBODY}); refusing to run model-written code as uid {os.geteuid()} unconfined"
        )
    try:
        r = _run("import os; print(os.getuid())", 10.0, 256 << 20, 1 << 20, 1 << 20, 4096, 4096)
    except SandboxUnavailable as exc:
        return str(exc)
    if not r.ok or r.stdout.strip() != str(NOBODY):
        return f"the code sandbox failed its self-test (rc={r.returncode}): {r.stderr.strip()[-300:]}"
    return None


def _run(code, timeout_s, mem_bytes, file_bytes, disk_bytes, output_bytes, result_bytes) -> SandboxResult:
    with tempfile.TemporaryDirectory(prefix="canvasq-sbx-") as tmp:
        os.chmod(tmp, 0o700)
        program = os.path.join(tmp, "main.py")
        with open(program, "w", encoding="utf-8", errors="surrogatepass") as f:
            f.write(code)
        os.mkdir(os.path.join(tmp, "root"))
        res_r, res_w = os.pipe()
        st_r, st_w = os.pipe()
        cfg = _launcher_config(tmp, program, timeout_s, mem_bytes, file_bytes, disk_bytes, st_w, res_w)
        try:
            proc = subprocess.Popen(
                [os.path.realpath(sys.executable), "-I", "-S", "-B", "-c", _LAUNCHER, json.dumps(cfg)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=(res_w, st_w),
                start_new_session=True,
                env={"LANG": "C.UTF-8"},
            )
        finally:
            os.close(res_w)
            os.close(st_w)
        assert proc.stdout is not None and proc.stderr is not None  # both PIPE
        out, err = proc.stdout.fileno(), proc.stderr.fileno()
        caps = {out: output_bytes, err: output_bytes, res_r: result_bytes, st_r: 64 * 1024}
        bufs, over = _drain(caps, deadline=time.monotonic() + timeout_s + 15.0)
        if proc.poll() is None:  # the launcher enforces the timeout; this is the backstop
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        for fd in (res_r, st_r):
            os.close(fd)
        proc.stdout.close()
        proc.stderr.close()
    return _result(bufs[st_r], bufs[out], bufs[err], bufs[res_r], truncated=bool(over))


def _launcher_config(
    tmp: str, program: str, timeout_s, mem_bytes, file_bytes, disk_bytes, status_fd: int, result_fd: int
) -> dict:
    """The launcher's config: its root under `tmp`, the program, the guard, the uid, the limits, the pipes."""
    cpu_s = max(1, int(timeout_s) + 1)
    return {
        "root": os.path.join(tmp, "root"),
        "program": program,
        "python": os.path.realpath(sys.executable),
        "guard": _GUARD,
        "ro_paths": _read_only_paths(),
        "uid": NOBODY,
        "timeout": timeout_s,
        "disk_bytes": disk_bytes,
        "status_fd": status_fd,
        "result_fd": result_fd,
        "rlimits": {
            "RLIMIT_CPU": cpu_s,
            "RLIMIT_AS": mem_bytes,
            "RLIMIT_FSIZE": file_bytes,
            "RLIMIT_NOFILE": 32,
            "RLIMIT_CORE": 0,
            "RLIMIT_NPROC": 16,
        },
    }


def _result(status_raw: bytes, stdout: bytes, stderr: bytes, result: bytes, truncated: bool) -> SandboxResult:
    """The run's result from the launcher's status lines (none: timed out); a setup error raises."""
    status = [json.loads(line) for line in status_raw.decode(errors="replace").splitlines() if line.strip()]
    for s in status:
        if "setup_error" in s:
            raise SandboxUnavailable(f"the code sandbox could not be set up: {s['setup_error']}")
    final = status[-1] if status else {"returncode": None, "timed_out": True}
    rc, timed_out = final.get("returncode"), bool(final.get("timed_out"))
    return SandboxResult(
        ok=rc == 0 and not timed_out,
        returncode=None if timed_out else rc,
        stdout=stdout.decode(errors="replace"),
        stderr=stderr.decode(errors="replace"),
        timed_out=timed_out,
        result=result,
        truncated=truncated,
    )


def _drain(caps: dict[int, int], deadline: float) -> tuple[dict[int, bytes], set[int]]:
    """Read every fd to EOF (or the deadline), keeping at most caps[fd] bytes of each: the rest is
    read and dropped, so a chatty child neither blocks nor grows our memory."""
    bufs = {fd: bytearray() for fd in caps}
    over: set[int] = set()
    with selectors.DefaultSelector() as sel:
        for fd in caps:
            sel.register(fd, selectors.EVENT_READ)
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for key, _ in sel.select(timeout=left):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    sel.unregister(key.fd)
                    continue
                room = caps[key.fd] - len(bufs[key.fd])
                if len(chunk) > room:
                    over.add(key.fd)
                bufs[key.fd] += chunk[: max(room, 0)]
    return {fd: bytes(b) for fd, b in bufs.items()}, over
