"""Runs untrusted Python -- model-written code (the python tool) and tenant code (reward files) -- in a confined
child process. This is the parent side: choosing the isolation level, building the command, limits, killing;
confine.py is what runs inside the child before the untrusted code.

Isolation levels, strongest first. `isolation: auto` takes the first one this node can run, found once per
process by starting a real sandbox at each level; naming a level insists on it (SandboxUnavailable if not).

| level      | needs (no root required)                    | the code sees / is refused                            |
|------------|---------------------------------------------|-------------------------------------------------------|
| `bwrap`    | bubblewrap and unprivileged user namespaces | its own mount, pid, net, ipc and uts namespaces. The  |
|            | (as root: bubblewrap only)                  | filesystem is the interpreter, the work dir (rw) and  |
|            |                                             | the task's data files, all else read-only and absent: |
|            |                                             | no /etc, /home, run dir, other tenants; a /proc of    |
|            |                                             | its own processes; no network interface.              |
| `landlock` | Linux >= 5.13 with Landlock enabled         | the real tree, but the kernel refuses reads outside   |
|            |                                             | the interpreter, work dir and data files, writes      |
|            |                                             | outside the work dir, execute, TCP (ABI >= 4), signals |
|            |                                             | and abstract sockets out of the sandbox (ABI >= 6);   |
|            |                                             | an empty network namespace where `unshare -n` works.  |
| `rlimits`  | nothing                                     | every file its uid may read or write: NOT a file      |
|            |                                             | boundary. Refused unless `allow_unisolated`.          |

Every level adds, inside the child: the dedicated unprivileged uid when the job runs as root (one per call or
worker from `uid_range`; at `landlock`/`rlimits` only if that uid can read the interpreter, else uid 0
stripped of every capability), no capabilities, no_new_privs, a seccomp filter (x86_64, aarch64: no new
processes, exec, sockets, ptrace, signals to other processes, mounts, namespaces, io_uring, bpf, keyrings),
rlimits (address space, file size, CPU, open files, processes for a dedicated uid), a wall-clock limit that
SIGKILLs it (and, for a dedicated uid, every process of that uid), no inherited environment or file
descriptors, death with its parent, and the Python audit hook as a last, non-security layer (`audit_hook`).
As a normal user (a Slurm job) the code keeps the job's uid: the namespaces or Landlock are then the boundary.
"""
from __future__ import annotations

import fcntl
import functools
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

from marlaas_hpc.config_loader import SpecError, bounded, check_bounds
from marlaas_hpc.env import confine

LEVELS = ("bwrap", "landlock", "rlimits")
"""Isolation levels, strongest first (see the module docstring)."""
ISOLATION_CHOICES = ("auto",) + LEVELS
DEFAULT_UID_RANGE = (1_900_000_000, 1_900_001_024)
"""Sandbox uids when the job runs as root: far above any login or systemd dynamic user."""
SYSTEM_LIB_DIRS = ("/usr", "/lib", "/lib64", "/lib32", "/libx32")
DEVICE_FILES = ("/dev/null", "/dev/zero", "/dev/urandom", "/dev/random")


@dataclass(kw_only=True, frozen=True)
class SandboxLimits:
    cpu_seconds: int | None = bounded(2, ge=1, unit="seconds")
    """RLIMIT_CPU of the child (SIGXCPU at this many CPU seconds); None: no CPU limit (long-lived workers,
    whose calls the wall-clock limit bounds)."""
    wall_seconds: float = bounded(5.0, gt=0, unit="seconds")
    """Wall-clock limit of a run (of each call, for a function worker); then the child is SIGKILLed."""
    memory_bytes: int = bounded(512 * 2**20, ge=1, unit="bytes")
    """RLIMIT_AS (address space) of the child."""
    max_processes: int = bounded(8, ge=1)
    """RLIMIT_NPROC, set only for a dedicated sandbox uid (it counts every process of the uid)."""
    file_bytes: int = bounded(1 * 2**20, ge=1, unit="bytes")
    """RLIMIT_FSIZE: largest file the child may write, stdout/stderr included."""
    max_output_chars: int = bounded(1000, ge=1)
    """stdout (and the error tail) returned to the model is cut to this many characters."""
    network: bool = bounded(False)
    """Allow network access (no namespace, sockets allowed). Off by default."""
    isolation: str = bounded("auto", choices=ISOLATION_CHOICES)
    """'auto' (strongest available), 'bwrap', 'landlock' or 'rlimits' (see the module docstring)."""
    allow_unisolated: bool = bounded(False)
    """Run even where only the 'rlimits' level is available (no file isolation)."""
    uid_range: tuple[int, int] | None = DEFAULT_UID_RANGE
    """Only as root: run each call / worker as its own uid from [lo, hi) (RLIMIT_NPROC then applies and
    leftovers are killed by uid). None: stay uid 0, without capabilities."""
    audit_hook: bool = bounded(True)
    """The in-child Python audit hook (clearer messages; not a boundary). Tests turn it off."""

    def validate(self) -> "SandboxLimits":
        """Refuses a bad limit with a SpecError (a ValueError) naming it, `sandbox.<field>`."""
        check_bounds(self, "sandbox")
        if self.uid_range is not None and not (len(self.uid_range) == 2 and all(map(_positive_int, self.uid_range))
                                               and self.uid_range[0] < self.uid_range[1] < 2**32 - 1):
            raise SpecError("sandbox.uid_range", f"must be (lo, hi) with 0 < lo < hi < 2**32 - 1, got "
                                                 f"{self.uid_range!r}")
        return self


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


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


class SandboxUnavailable(RuntimeError):
    """The isolation asked for cannot be had on this node (the message says what is missing)."""


# ---------------------------------------------------------------- what this node offers
@dataclass(frozen=True)
class Isolation:
    """The level chosen on this node and the kernel features every level adds."""

    level: str
    landlock_abi: int
    seccomp_arch: str | None
    as_root: bool
    uid_drop: bool
    """As root: the sandbox uid can run the interpreter (else the code stays uid 0 without capabilities)."""
    notes: tuple[str, ...] = ()
    """Why stronger levels were passed over."""

    def describe(self) -> str:
        parts = [f"{self.level} (Landlock ABI {self.landlock_abi})" if self.level == "landlock" else self.level,
                 f"seccomp {self.seccomp_arch}" if self.seccomp_arch else "no seccomp filter"]
        if self.as_root:
            parts.append("own uid" if self.uid_drop else "uid 0 without capabilities")
        return ", ".join(parts)


_probe_lock = threading.Lock()


@functools.lru_cache(maxsize=None)
def _probe(requested: str, uid_range: tuple[int, int] | None) -> Isolation:
    """Tries each level (strongest first, or just the one asked for) with a real sandbox run."""
    as_root = os.geteuid() == 0
    base = Isolation("rlimits", confine.landlock_abi(), confine.seccomp_arch(), as_root, False)
    notes = []
    for level in (LEVELS if requested == "auto" else (requested,)):
        candidate = replace(base, level=level, uid_drop=_can_drop_uid(level, as_root, uid_range))
        why = _why_not(candidate, uid_range)
        if why is None:
            return replace(candidate, notes=tuple(notes))
        notes.append(f"{level}: {why}")
    raise SandboxUnavailable(f"sandbox isolation {requested!r} is not available here: " + "; ".join(notes))


def _can_drop_uid(level: str, as_root: bool, uid_range) -> bool:
    """Inside bwrap the interpreter is mounted world-traversable; elsewhere the sandbox uid must be able to
    read it where it lies."""
    if not as_root or uid_range is None:
        return False
    return level == "bwrap" or _uid_can_run_interpreter(uid_range)


def node_isolation(limits: SandboxLimits) -> Isolation:
    """The isolation `limits` get on this node (probed once per process)."""
    with _probe_lock:
        return _probe(limits.isolation, limits.uid_range)


def _why_not(isolation: Isolation, uid_range) -> str | None:
    if isolation.level == "bwrap" and shutil.which("bwrap") is None:
        return "bubblewrap (bwrap) is not installed"
    if isolation.level == "landlock" and not isolation.landlock_abi:
        return "the kernel has no Landlock (Linux >= 5.13, 'landlock' in the LSM list)"
    limits = SandboxLimits(cpu_seconds=10, wall_seconds=60, uid_range=uid_range, allow_unisolated=True)
    with _uid_slot(limits, isolation) as uid, tempfile.TemporaryDirectory(prefix="marlaas-probe-") as tmp:
        workdir = Path(tmp)
        (workdir / "main.py").write_text("import json\n")
        proc = _popen(workdir, isolation, _child_config(workdir, limits, isolation, uid, "script"), limits,
                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, uid=uid)
        try:
            out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            _kill(proc, uid)
            return "a trial run did not finish in 60 s"
    if proc.returncode != 0:
        return f"a trial run failed (exit {proc.returncode}): {err.decode(errors='replace').strip()[-300:]}"
    return None


@functools.lru_cache(maxsize=None)
def _uid_can_run_interpreter(uid_range: tuple[int, int]) -> bool:
    """Whether a sandbox uid can read the interpreter where it lies (e.g. not under a 0700 /root)."""
    try:
        proc = subprocess.run([sys.executable, "-I", "-c", "import json, encodings.idna"], user=uid_range[0],
                              group=uid_range[0], extra_groups=[], capture_output=True, timeout=60, cwd="/")
    except (OSError, subprocess.SubprocessError):
        return False
    return proc.returncode == 0


@functools.lru_cache(maxsize=1)
def interpreter_paths() -> tuple[str, ...]:
    """What the interpreter needs to read: its prefixes, its default sys.path (without PYTHONPATH or the
    user site) and the system library dirs; nested paths folded into their ancestors."""
    out = subprocess.run([sys.executable, "-I", "-c", "import sys, json; print(json.dumps(sys.path))"],
                         capture_output=True, text=True, timeout=120, cwd="/", env={"PATH": "/usr/bin:/bin"})
    paths = set(json.loads(out.stdout)) if out.returncode == 0 else set()
    paths |= {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
              os.path.dirname(os.path.realpath(sys.executable)), *SYSTEM_LIB_DIRS}
    existing = sorted({os.path.abspath(p) for p in paths if p and os.path.exists(p)})
    return tuple(p for p in existing if not any(p != q and p.startswith(q.rstrip("/") + "/") for q in existing))


def network_isolation_prefix() -> list[str]:
    """Command prefix that puts the child in an empty network namespace ([] if the kernel refuses)."""
    return list(_netns_prefix())


@functools.lru_cache(maxsize=1)
def _netns_prefix() -> tuple[str, ...]:
    for prefix in (["unshare", "-n", "--"], ["unshare", "-rn", "--"]):
        try:
            if subprocess.run(prefix + ["true"], capture_output=True, timeout=10).returncode == 0:
                return tuple(prefix)
        except (OSError, subprocess.SubprocessError):
            continue
    return ()


# ---------------------------------------------------------------- the command
def _child_config(workdir: Path, limits: SandboxLimits, isolation: Isolation, uid: int | None, mode: str,
                  read_files: tuple[str, ...] = (), **extra) -> dict:
    return {"mode": mode, "uid": uid, "cpu": limits.cpu_seconds, "mem": limits.memory_bytes,
            "fsize": limits.file_bytes, "nproc": limits.max_processes, "network": limits.network,
            "hook": limits.audit_hook, "pid_namespace": isolation.level == "bwrap",
            "landlock": isolation.landlock_abi if isolation.level == "landlock" else 0,
            "seccomp": isolation.seccomp_arch,
            "read_paths": list(interpreter_paths()) + ["/etc/ld.so.cache"], "read_files": list(read_files),
            "write_paths": [str(workdir)], "device_files": list(DEVICE_FILES), **extra}


@functools.lru_cache(maxsize=1)
def _child_source() -> str:
    """confine.py's source and its entry call: what `python -I -c` runs in the child."""
    return Path(confine.__file__).read_text() + "\nmain(json.loads(sys.argv[1]))\n"


def _command(workdir: Path, isolation: Isolation, cfg: dict, limits: SandboxLimits) -> list[str]:
    python = [sys.executable, "-I", "-c", _child_source(), json.dumps(cfg)]
    if isolation.level == "bwrap":
        return _bwrap_args(workdir, isolation, cfg["read_files"], limits.network) + ["--"] + python
    return ([] if limits.network else network_isolation_prefix()) + python


def _bwrap_args(workdir: Path, isolation: Isolation, read_files, network: bool) -> list[str]:
    if isolation.as_root:  # privileged bwrap, no user namespace: confine.py then drops to the sandbox uid
        args = ["bwrap", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
                "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"] + ([] if network else ["--unshare-net"])
    else:
        args = ["bwrap", "--unshare-all", "--cap-drop", "ALL"] + (["--share-net"] if network else [])
    args += ["--die-with-parent", "--new-session", "--dev", "/dev", "--proc", "/proc"]
    made: set[str] = {"/", "/dev", "/proc"}
    for path in interpreter_paths():
        if os.path.islink(path) and os.path.dirname(path) == "/":  # merged /usr: /lib -> usr/lib
            args += ["--symlink", os.readlink(path), path]
        else:
            args += _parents(path, made) + ["--ro-bind", path, path]
    if os.path.exists("/etc/ld.so.cache"):
        args += _parents("/etc/ld.so.cache", made) + ["--ro-bind", "/etc/ld.so.cache", "/etc/ld.so.cache"]
    for path in read_files:
        args += _parents(path, made) + ["--ro-bind", path, path]
    args += _parents(str(workdir), made) + ["--bind", str(workdir), str(workdir), "--chdir", str(workdir)]
    return args + ["--remount-ro", "/"]  # everything but the work dir (its own mount) read-only


def _parents(path: str, made: set[str]) -> list[str]:
    """Creates the ancestors of a mount point world-traversable (bwrap's own would be 0700)."""
    args = []
    for parent in reversed(Path(path).parents):
        name = str(parent)
        if name not in made:
            made.add(name)
            args += ["--perms", "0755", "--dir", name]
    return args


def _child_env(workdir: Path) -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin", "HOME": str(workdir), "TMPDIR": str(workdir), "LANG": "C.UTF-8",
            "PYTHONIOENCODING": "utf-8", "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1",
            "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


_launcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sandbox-launcher")
"""Starts every sandbox child. The child dies with the *thread* that started it (PR_SET_PDEATHSIG, bwrap's
--die-with-parent), so that thread must live as long as the process: not an env-pool thread, which may end
(abandoned after a step timeout) while a worker it started serves another task."""


def _popen(workdir: Path, isolation: Isolation, cfg: dict, limits: SandboxLimits, uid: int | None,
           **streams) -> subprocess.Popen:
    if uid is not None:
        os.chown(workdir, uid, uid)
    return _launcher.submit(subprocess.Popen, _command(workdir, isolation, cfg, limits), cwd=workdir,
                            env=_child_env(workdir), start_new_session=True, close_fds=True, **streams).result()


def _kill(proc: subprocess.Popen, uid: int | None) -> None:
    """SIGKILLs the child's process group (bwrap takes its namespace down with it), then, for a dedicated
    uid, every process left of that uid."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    if uid is not None:
        _kill_uid(uid)


# ---------------------------------------------------------------- uids
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


class _uid_slot:
    """Context manager: a dedicated uid for one sandbox (None when not root or the level keeps uid 0)."""

    def __init__(self, limits: SandboxLimits, isolation: Isolation):
        self.wanted = isolation.as_root and isolation.uid_drop and limits.uid_range is not None
        self.range = limits.uid_range
        self.slot = None

    def __enter__(self) -> int | None:
        if self.wanted:
            self.slot = _uid_slots.acquire(*self.range)
            return self.slot[0]
        return None

    def __exit__(self, *exc) -> None:
        if self.slot is not None:
            _uid_slots.release(*self.slot)


def _kill_uid(uid: int) -> None:
    """kill(-1) as `uid` SIGKILLs every process of that uid (escapees from the process group too); repeated
    until none is left running, since a process forked during one sweep can miss it."""
    for _ in range(50):
        if not _running_processes_of(uid):
            return
        try:
            subprocess.run(["kill", "-9", "-1"], user=uid, group=uid, extra_groups=[], capture_output=True,
                           timeout=10)
        except (OSError, subprocess.SubprocessError):
            return
        time.sleep(0.02)


def _running_processes_of(uid: int) -> list[int]:
    """Pids of `uid` that are not zombies (from /proc: a stat per process, its status only for that uid's)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.stat(f"/proc/{entry}").st_uid != uid:
                continue
            state = Path(f"/proc/{entry}/stat").read_text().rpartition(")")[2].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z":
            pids.append(int(entry))
    return pids


def _checked_isolation(limits: SandboxLimits) -> Isolation:
    isolation = node_isolation(limits)
    if isolation.level == "rlimits" and not limits.allow_unisolated:
        raise SandboxUnavailable("no file isolation on this node (" + "; ".join(isolation.notes) + "); "
                                 "set sandbox.allow_unisolated: true to run untrusted code with rlimits only")
    return isolation


# ---------------------------------------------------------------- one-shot scripts (the python tool)
_FENCE = re.compile(r"^\s*```(?:python|py)?\s*\n(.*?)\n?```\s*$", re.S)


def strip_code_fence(code: str) -> str:
    match = _FENCE.match(code)
    return match.group(1) if match else code


def run_python(code: str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Runs `code` as a script under `limits`; never raises for anything the code does."""
    try:
        isolation = _checked_isolation(limits)
    except SandboxUnavailable as exc:
        return SandboxResult("start_failed", "", str(exc), None, 0.0)
    with _uid_slot(limits, isolation) as uid, tempfile.TemporaryDirectory(prefix="marlaas-py-") as tmp:
        return _run_in(Path(tmp), strip_code_fence(code), limits, isolation, uid)


def _run_in(workdir: Path, code: str, limits: SandboxLimits, isolation: Isolation, uid: int | None) -> SandboxResult:
    (workdir / "main.py").write_text(code, encoding="utf-8")
    cfg = _child_config(workdir, limits, isolation, uid, "script")
    start = time.monotonic()
    timed_out = False
    with open(workdir / ".stdout", "wb") as out, open(workdir / ".stderr", "wb") as err:
        try:
            proc = _popen(workdir, isolation, cfg, limits, uid, stdin=subprocess.DEVNULL, stdout=out, stderr=err)
        except OSError as exc:
            return SandboxResult("start_failed", "", str(exc), None, time.monotonic() - start)
        try:
            returncode = proc.wait(timeout=limits.wall_seconds)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            _kill(proc, uid)  # also the stragglers the child left
        returncode = _exit_code(proc.returncode, isolation)
    seconds = time.monotonic() - start
    stdout = _head(workdir / ".stdout", limits.max_output_chars)
    stderr = _tail(workdir / ".stderr", limits.max_output_chars)
    return SandboxResult(_status(returncode, timed_out, stderr), stdout, stderr, returncode, seconds)


def _exit_code(returncode: int, isolation: Isolation) -> int:
    """bwrap reports a child killed by signal N as exit status 128 + N: made -N, as subprocess does."""
    if isolation.level == "bwrap" and 128 < returncode < 128 + 65:
        return 128 - returncode
    return returncode


def _status(returncode: int, timed_out: bool, stderr: str) -> str:
    if timed_out:
        return "timeout"
    if returncode == 0:
        return "ok"
    if returncode == confine.EXIT_CONFINE_FAILED:
        return "start_failed"
    if returncode in (-signal.SIGXCPU, -signal.SIGKILL) and "MemoryError" not in stderr:
        return "cpu_limit"
    if returncode == -signal.SIGXFSZ:
        return "output_limit"
    if returncode == confine.EXIT_MEMORY or "MemoryError" in stderr:
        return "memory_limit"
    if "File too large" in stderr:
        return "output_limit"
    if returncode == confine.EXIT_BLOCKED:
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


# ---------------------------------------------------------------- long-lived function workers (tenant code)
class WorkerDied(RuntimeError):
    """The function worker exited (killed by a limit, or the code ended the process)."""


class WorkerTimeout(RuntimeError):
    """A call did not answer within the wall-clock limit; the worker was killed."""


@dataclass
class FunctionWorker:
    """One confined process that loaded `function` from a source file and answers calls over a pipe.
    `call` sends one JSON request and waits at most limits.wall_seconds for the reply; the worker is killed
    on a timeout and whenever it cannot go on. Not thread-safe: the caller serialises calls."""

    source: str
    filename: str
    """Name the source gets in the work dir (its original base name: tracebacks show it)."""
    function: str
    limits: SandboxLimits
    read_files: tuple[str, ...] = ()
    """Files the code may read (the task's data), by their real path."""
    display_name: str = ""
    proc: subprocess.Popen | None = field(default=None, init=False)
    _buffer: bytes = field(default=b"", init=False)
    _uid: int | None = field(default=None, init=False)
    _slot: "_uid_slot | None" = field(default=None, init=False)
    _tmp: tempfile.TemporaryDirectory | None = field(default=None, init=False)
    _stderr: object = field(default=None, init=False)
    _isolation: Isolation | None = field(default=None, init=False)

    def start(self) -> None:
        """Starts the worker and waits for its function to load; WorkerDied with the loading error if not."""
        isolation = self._isolation = _checked_isolation(self.limits)
        self._slot = _uid_slot(self.limits, isolation)
        self._uid = self._slot.__enter__()
        self._tmp = tempfile.TemporaryDirectory(prefix="marlaas-fn-")
        workdir = Path(self._tmp.name)
        code = workdir / self.filename
        code.write_text(self.source, encoding="utf-8")
        code.chmod(0o444)
        cfg = _child_config(workdir, self.limits, isolation, self._uid, "function", self.read_files,
                            filename=str(code), function=self.function, module_name=Path(self.filename).stem,
                            display_name=self.display_name or self.filename)
        self._stderr = open(workdir / ".stderr", "wb")
        self._buffer = b""
        try:
            self.proc = _popen(workdir, isolation, cfg, self.limits, self._uid, stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=self._stderr)
        except OSError as exc:
            self.stop()
            raise WorkerDied(f"cannot start the sandbox: {exc}") from None
        reply = self._reply(max(self.limits.wall_seconds, 60.0))  # start-up: imports on a busy node
        if not reply.get("ready"):
            self.stop()
            raise WorkerDied(reply.get("error", "the worker did not load its function"))

    def call(self, request: dict) -> dict:
        if self.proc is None:
            self.start()
        try:
            self.proc.stdin.write(json.dumps(request, default=str).encode() + b"\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise self._died() from None
        return self._reply(self.limits.wall_seconds)

    def _reply(self, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                self.stop()
                raise WorkerTimeout(f"no answer within {timeout_s:g} s")
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                raise self._died()
            self._buffer += chunk
            if len(self._buffer) > 1 << 20:
                self.stop()
                raise WorkerDied("the worker's reply exceeded 1 MiB")
        line, _, self._buffer = self._buffer.partition(b"\n")
        try:
            reply = json.loads(line)
        except ValueError:
            self.stop()
            raise WorkerDied("the worker sent a malformed reply") from None
        return reply if isinstance(reply, dict) else {"ok": False, "error": "malformed reply"}

    def _died(self) -> WorkerDied:
        code = _exit_code(self.proc.wait(), self._isolation) if self.proc is not None else None
        tail = _tail(Path(self._tmp.name) / ".stderr", 300).strip() if self._tmp is not None else ""
        self.stop()
        why = {confine.EXIT_CONFINE_FAILED: "the sandbox could not be set up"}.get(code, "")
        if code is not None and code < 0:
            why = f"killed by signal {signal.Signals(-code).name}" + (
                " (CPU limit)" if code == -signal.SIGXCPU else " (file size limit)" if code == -signal.SIGXFSZ
                else " (a limit or the out-of-memory killer)" if code == -signal.SIGKILL else "")
        return WorkerDied(f"the worker process ended ({why or f'exit status {code}'})"
                          + (f": {tail.splitlines()[-1]}" if tail else ""))

    def stop(self) -> None:
        if self.proc is not None:
            _kill(self.proc, self._uid)
            for stream in (self.proc.stdin, self.proc.stdout):
                try:
                    stream.close()
                except OSError:
                    pass
            self.proc = None
        if self._stderr is not None:
            self._stderr.close()
            self._stderr = None
        if self._slot is not None:
            self._slot.__exit__(None, None, None)
            self._slot, self._uid = None, None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
