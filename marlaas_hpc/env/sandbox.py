"""Runs model-written Python in a subprocess with CPU, memory, process, output and wall-clock limits.

Layers, outermost first (each holds on its own where the others are unavailable):
- network: a fresh network namespace (`unshare -n`, or `unshare -rn` without root) where the kernel allows
  it; always also an audit hook in the child that refuses every ``socket.*`` event;
- processes: the audit hook refuses fork / exec / spawn / subprocess / os.system / kill and ctypes calls;
  RLIMIT_NPROC caps processes for a non-root user (root ignores it: give `uid_range` to run each call as its
  own unprivileged uid, which makes the cap real and lets us kill every leftover process of that uid);
- time: RLIMIT_CPU (SIGXCPU) and a wall-clock timeout that SIGKILLs the whole process group;
- memory: RLIMIT_AS (an allocation over it raises MemoryError in the child);
- files: a fresh temp working dir; writes outside it are refused by the audit hook; RLIMIT_FSIZE caps every
  file, including the stdout/stderr files, so an endless print loop dies with SIGXFSZ.
The child never inherits the parent's environment or file descriptors.
"""
from __future__ import annotations

import fcntl
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(kw_only=True, frozen=True)
class SandboxLimits:
    cpu_seconds: int = 2
    """RLIMIT_CPU of the child (SIGXCPU at this many CPU seconds)."""
    wall_seconds: float = 5.0
    """Wall-clock limit; then the child's whole process group is SIGKILLed."""
    memory_bytes: int = 512 * 2**20
    """RLIMIT_AS (address space) of the child."""
    max_processes: int = 8
    """RLIMIT_NPROC (counts every process/thread of the uid; root is exempt unless uid_range is set)."""
    file_bytes: int = 1 * 2**20
    """RLIMIT_FSIZE: largest file the child may write, stdout/stderr included."""
    max_output_chars: int = 1000
    """stdout (and the error tail) returned to the model is cut to this many characters."""
    network: bool = False
    """Allow network access (no namespace, no socket block). Off by default."""
    uid_range: tuple[int, int] | None = None
    """Only as root: run each call as its own uid from [lo, hi) so RLIMIT_NPROC applies and leftovers
    can be killed by uid. The interpreter and site-packages must then be readable by those uids."""
    audit_hook: bool = True
    """The in-child audit hook (socket/fork/exec/write refusal). Turn off only to test the kernel layers."""

    def validate(self) -> "SandboxLimits":
        for name in ("cpu_seconds", "memory_bytes", "max_processes", "file_bytes", "max_output_chars"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"sandbox.{name} must be a positive integer, got {getattr(self, name)!r}")
        if not self.wall_seconds > 0:
            raise ValueError(f"sandbox.wall_seconds must be > 0, got {self.wall_seconds!r}")
        if self.uid_range is not None and not 0 < self.uid_range[0] < self.uid_range[1]:
            raise ValueError(f"sandbox.uid_range must be (lo, hi) with 0 < lo < hi, got {self.uid_range!r}")
        return self


@dataclass(frozen=True)
class SandboxResult:
    status: str
    """'ok', 'error' (exception / non-zero exit), 'timeout', 'cpu_limit', 'memory_limit', 'output_limit',
    'blocked' (a refused operation was the uncaught error) or 'start_failed'."""
    stdout: str
    stderr_tail: str
    returncode: int | None
    seconds: float

    @property
    def ok(self) -> bool:
        return self.status == "ok"


# Runs inside the child as `python -I -c BOOT CONFIG`: drop privileges, set limits, install the audit hook,
# then run main.py from the working dir. Kept import-light: everything here is imported before the hook.
_BOOT = r'''
import json, os, resource, sys, traceback
cfg = json.loads(sys.argv[1])
if cfg["uid"] is not None and os.getuid() == 0:
    os.setgroups([]); os.setgid(cfg["uid"]); os.setuid(cfg["uid"])
def _limit(name, soft, hard=None):
    resource.setrlimit(getattr(resource, name), (soft, soft if hard is None else hard))
_limit("RLIMIT_CPU", cfg["cpu"], cfg["cpu"] + 1)
_limit("RLIMIT_AS", cfg["mem"])
_limit("RLIMIT_FSIZE", cfg["fsize"])
_limit("RLIMIT_CORE", 0)
_limit("RLIMIT_NPROC", cfg["nproc"])
_limit("RLIMIT_NOFILE", 64)
_home = os.path.realpath(os.getcwd())
_BLOCKED = {"os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.system", "os.exec", "os.kill",
            "os.killpg", "signal.pthread_kill", "subprocess.Popen", "pty.spawn", "ctypes.dlsym",
            "ctypes.dlsym/handle", "ctypes.call_function", "ctypes.cdata", "sys.addaudithook"}
_PATH_EVENTS = {"os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.symlink",
                "os.link", "os.truncate", "os.utime", "shutil.rmtree", "shutil.move", "shutil.copyfile"}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
def _inside(path):
    if isinstance(path, int):
        return True
    real = os.path.realpath(os.fsdecode(path))
    return real == _home or real.startswith(_home + os.sep) or real == os.devnull
def _hook(event, args):
    if event in _BLOCKED or (not cfg["network"] and event.startswith("socket.")):
        raise PermissionError(f"sandbox: {event} is not allowed")
    if event == "open":
        path, mode, flags = args
        writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or bool((flags or 0) & _WRITE_FLAGS)
        if writing and not _inside(path):
            raise PermissionError(f"sandbox: writing outside the working dir is not allowed: {path!r}")
    elif event in _PATH_EVENTS:
        for path in args:
            if isinstance(path, (str, bytes, os.PathLike)) and not _inside(path):
                raise PermissionError(f"sandbox: {event} outside the working dir is not allowed")
if cfg["hook"]:
    sys.addaudithook(_hook)
sys.argv = ["main.py"]
_code = compile(open("main.py", encoding="utf-8").read(), "main.py", "exec")
try:
    exec(_code, {"__name__": "__main__", "__builtins__": __builtins__})
except MemoryError:
    sys.stderr.write("MemoryError: memory limit exceeded\n"); sys.stderr.flush(); os._exit(3)
except SystemExit:
    raise
except BaseException as exc:
    traceback.print_exc()
    sys.stdout.flush(); sys.stderr.flush()
    os._exit(4 if isinstance(exc, PermissionError) and "sandbox:" in str(exc) else 1)
'''

_FENCE = re.compile(r"^\s*```(?:python|py)?\s*\n(.*?)\n?```\s*$", re.S)
_netns_prefix: list[str] | None = None
_netns_lock = threading.Lock()


def network_isolation_prefix() -> list[str]:
    """Command prefix that puts the child in an empty network namespace ([] if the kernel refuses)."""
    global _netns_prefix
    with _netns_lock:
        if _netns_prefix is None:
            _netns_prefix = []
            for prefix in (["unshare", "-n", "--"], ["unshare", "-rn", "--"]):
                try:
                    if subprocess.run(prefix + ["true"], capture_output=True, timeout=10).returncode == 0:
                        _netns_prefix = prefix
                        break
                except (OSError, subprocess.SubprocessError):
                    continue
        return list(_netns_prefix)


class _UidSlots:
    """Hands out distinct uids from a range, across threads (lock) and processes (flock)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._held: set[int] = set()

    def acquire(self, lo: int, hi: int) -> tuple[int, int]:
        with self._lock:
            for uid in range(lo, hi):
                if uid in self._held:
                    continue
                fd = os.open(os.path.join(tempfile.gettempdir(), f"marlaas-sandbox-uid-{uid}.lock"),
                             os.O_CREAT | os.O_RDWR, 0o600)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    os.close(fd)
                    continue
                self._held.add(uid)
                return uid, fd
        raise RuntimeError(f"no free sandbox uid in [{lo}, {hi})")

    def release(self, uid: int, fd: int) -> None:
        with self._lock:
            self._held.discard(uid)
            os.close(fd)


_uid_slots = _UidSlots()


def strip_code_fence(code: str) -> str:
    match = _FENCE.match(code)
    return match.group(1) if match else code


def run_python(code: str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Runs `code` as a script under `limits`; never raises for anything the code does."""
    uid_slot = None
    if limits.uid_range is not None and os.getuid() == 0:
        uid_slot = _uid_slots.acquire(*limits.uid_range)
    try:
        with tempfile.TemporaryDirectory(prefix="marlaas-py-") as tmp:
            return _run_in(Path(tmp), strip_code_fence(code), limits, uid_slot[0] if uid_slot else None)
    finally:
        if uid_slot is not None:
            _uid_slots.release(*uid_slot)


def _run_in(workdir: Path, code: str, limits: SandboxLimits, uid: int | None) -> SandboxResult:
    (workdir / "main.py").write_text(code, encoding="utf-8")
    if uid is not None:
        os.chown(workdir, uid, uid)
        os.chown(workdir / "main.py", uid, uid)
    cfg = {"cpu": limits.cpu_seconds, "mem": limits.memory_bytes, "fsize": limits.file_bytes,
           "nproc": limits.max_processes, "uid": uid, "network": limits.network,
           "hook": limits.audit_hook}
    cmd = ([] if limits.network else network_isolation_prefix()) + \
        [sys.executable, "-I", "-c", _BOOT, json.dumps(cfg)]
    env = {"PATH": "/usr/bin:/bin", "HOME": str(workdir), "LANG": "C.UTF-8", "PYTHONIOENCODING": "utf-8",
           "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    start = time.monotonic()
    timed_out = False
    with open(workdir / ".stdout", "wb") as out, open(workdir / ".stderr", "wb") as err:
        try:
            proc = subprocess.Popen(cmd, cwd=workdir, stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=env,
                                    start_new_session=True, close_fds=True)
        except OSError as exc:
            return SandboxResult("start_failed", "", str(exc), None, time.monotonic() - start)
        try:
            returncode = proc.wait(timeout=limits.wall_seconds)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(proc.pid)
            returncode = proc.wait()
        finally:
            _kill_group(proc.pid)  # stragglers the child left in its group
            if uid is not None:
                _kill_uid(uid)
    seconds = time.monotonic() - start
    stdout = _head(workdir / ".stdout", limits.max_output_chars)
    stderr = _tail(workdir / ".stderr", limits.max_output_chars)
    return SandboxResult(_status(returncode, timed_out, stderr), stdout, stderr, returncode, seconds)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _kill_uid(uid: int) -> None:
    """kill(-1) as `uid` SIGKILLs every process of that uid (escapees from the process group too); repeated
    until none is left running, since a process forked during one sweep can miss it."""
    for _ in range(50):
        try:
            subprocess.run(["kill", "-9", "-1"], user=uid, group=uid, extra_groups=[], capture_output=True,
                           timeout=10)
        except (OSError, subprocess.SubprocessError):
            return
        if not _running_processes_of(uid):
            return
        time.sleep(0.02)


def _running_processes_of(uid: int) -> list[int]:
    """Pids of `uid` that are not zombies (from /proc)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            status = Path(f"/proc/{entry}/status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if int(fields.get("Uid", "-1 ").split()[0]) == uid and not fields.get("State", "").strip().startswith("Z"):
            pids.append(int(entry))
    return pids


def _status(returncode: int, timed_out: bool, stderr: str) -> str:
    if timed_out:
        return "timeout"
    if returncode == 0:
        return "ok"
    if returncode in (-signal.SIGXCPU, -signal.SIGKILL) and "MemoryError" not in stderr:
        return "cpu_limit"
    if returncode == -signal.SIGXFSZ:
        return "output_limit"
    if returncode == 3 or "MemoryError" in stderr:
        return "memory_limit"
    if "File too large" in stderr:
        return "output_limit"
    if returncode == 4:
        return "blocked"
    return "error"


def _head(path: Path, limit: int) -> str:
    with open(path, "rb") as f:
        data = f.read(limit * 4 + 4)
    text = data.decode("utf-8", errors="replace")
    return text[:limit] + ("...[truncated]" if len(text) > limit or os.path.getsize(path) > len(data) else "")


def _tail(path: Path, limit: int) -> str:
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        f.seek(max(0, size - limit * 4))
        return f.read().decode("utf-8", errors="replace")[-limit:]
