"""The inside of a sandbox child: confines the process, then runs untrusted code in it.

This file is standard library only and self-contained: its source is what the parent passes to
`python -I -c` (see sandbox.py), so it runs before anything of marlaas_hpc (or the tenant) is imported, and
inside a bubblewrap namespace where marlaas_hpc is not even visible. Order of `confine(cfg)`:

1. identity: as root, drop to the dedicated sandbox uid (cfg["uid"]); if none is given, stay uid 0 but give
   up every capability (bounding, permitted, effective, inheritable, ambient) -- the case of a user
   namespace's root or of an interpreter the sandbox uid cannot read;
2. rlimits: address space, file size, open files, core dumps, CPU seconds and processes where configured;
3. Landlock (the `landlock` level; ABI probed): reads only beneath cfg["read_paths"] (the interpreter) and the
   files of cfg["read_files"] (the task's data), writes only beneath cfg["write_paths"] (the work dir), no
   execute anywhere; ABI >= 4: no TCP bind/connect; ABI >= 6: no signals to, and no abstract unix sockets
   of, processes outside the sandbox;
4. seccomp (x86_64 and aarch64): new processes (fork, vfork, clone without CLONE_THREAD; clone3 answers
   ENOSYS so libc falls back to clone), execve, socket, ptrace, signals to other processes, mounts,
   namespaces, kernel keyrings, bpf, io_uring, open_by_handle_at and module / kexec calls are refused with
   EPERM; threads still work;
5. optionally the Python audit hook (cfg["hook"]): a last, non-security layer with friendlier messages.

Every requested layer must apply, or the child exits with status 5 and says which one failed: a sandbox
never runs code with less isolation than the parent asked for. Then either `run_script` (the python tool:
main.py in the work dir) or `serve_function` (a tenant function, called over a JSON-lines pipe).
"""
import ctypes
import json
import os
import resource
import struct
import sys
import traceback

EXIT_CONFINE_FAILED = 5
EXIT_BLOCKED = 4
EXIT_MEMORY = 3

# ---------------------------------------------------------------- Landlock (uapi/linux/landlock.h)
_SYS_LANDLOCK_CREATE_RULESET, _SYS_LANDLOCK_ADD_RULE, _SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446
_FS_EXECUTE, _FS_WRITE_FILE, _FS_READ_FILE, _FS_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
_FS_TRUNCATE, _FS_IOCTL_DEV = 1 << 14, 1 << 15
_PR_SET_NO_NEW_PRIVS, _PR_SET_PDEATHSIG, _PR_CAPBSET_DROP, _PR_CAP_AMBIENT = 38, 1, 24, 47
_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 22, 2


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    libc.prctl.restype = ctypes.c_int
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    return libc


def _fail(what: str) -> OSError:
    errno = ctypes.get_errno()
    return OSError(errno, f"{what}: {os.strerror(errno)}")


def landlock_abi() -> int:
    """The kernel's Landlock ABI version (0: no Landlock, or disabled at boot)."""
    version = _libc().syscall(_SYS_LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    return max(int(version), 0)


def _fs_rights(abi: int) -> int:
    rights = (1 << 13) - 1  # ABI 1: execute .. make_sym
    if abi >= 2:
        rights |= 1 << 13  # refer (link / rename across dirs)
    if abi >= 3:
        rights |= _FS_TRUNCATE
    if abi >= 5:
        rights |= _FS_IOCTL_DEV
    return rights


def apply_landlock(abi: int, read_paths, read_files, write_paths, device_files) -> None:
    """Restricts this process (and anything it could start) to the given paths; see the module docstring."""
    libc = _libc()
    handled = _fs_rights(abi)
    attr = struct.pack("=QQQ", handled, 3 if abi >= 4 else 0, 3 if abi >= 6 else 0)
    size = 8 if abi < 4 else 16 if abi < 6 else 24
    ruleset = libc.syscall(_SYS_LANDLOCK_CREATE_RULESET, ctypes.c_char_p(attr), ctypes.c_size_t(size),
                           ctypes.c_uint32(0))
    if ruleset < 0:
        raise _fail("landlock_create_ruleset")
    read_dir = _FS_READ_FILE | _FS_READ_DIR
    file_rw = (_FS_READ_FILE | _FS_WRITE_FILE | _FS_TRUNCATE | _FS_IOCTL_DEV) & handled
    rules = [(path, read_dir) for path in read_paths] + [(path, _FS_READ_FILE) for path in read_files] + \
        [(path, handled & ~_FS_EXECUTE) for path in write_paths] + [(path, file_rw) for path in device_files]
    try:
        for path, rights in rules:
            _landlock_rule(libc, ruleset, path, rights)
        if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise _fail("prctl(NO_NEW_PRIVS)")
        if libc.syscall(_SYS_LANDLOCK_RESTRICT_SELF, ctypes.c_int(ruleset), ctypes.c_uint32(0)) != 0:
            raise _fail("landlock_restrict_self")
    finally:
        os.close(ruleset)


def _landlock_rule(libc, ruleset: int, path: str, rights: int) -> None:
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except OSError:
        return  # a path this node does not have (e.g. /lib64 on aarch64) needs no rule
    try:
        if not os.path.isdir(path):
            rights &= _FS_READ_FILE | _FS_WRITE_FILE | _FS_TRUNCATE | _FS_IOCTL_DEV | _FS_EXECUTE
        rule = ctypes.create_string_buffer(struct.pack("=Qi", rights, fd), 12)
        if libc.syscall(_SYS_LANDLOCK_ADD_RULE, ctypes.c_int(ruleset), ctypes.c_int(1), rule, ctypes.c_uint32(0)):
            raise _fail(f"landlock_add_rule({path})")
    finally:
        os.close(fd)


# ---------------------------------------------------------------- seccomp-bpf
_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
# syscall numbers: x86_64 (asm/unistd_64.h), aarch64 (asm-generic/unistd.h)
_DENIED = {
    "x86_64": {"fork": 57, "vfork": 58, "execve": 59, "execveat": 322, "socket": 41, "ptrace": 101,
               "tkill": 200, "pidfd_open": 434, "pidfd_getfd": 438, "pidfd_send_signal": 424,
               "process_vm_readv": 310, "process_vm_writev": 311, "mount": 165, "umount2": 166,
               "pivot_root": 155, "chroot": 161, "unshare": 272, "setns": 308, "open_tree": 428,
               "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433,
               "mount_setattr": 442, "name_to_handle_at": 303, "open_by_handle_at": 304, "bpf": 321,
               "perf_event_open": 298, "userfaultfd": 323, "io_uring_setup": 425, "io_uring_enter": 426,
               "io_uring_register": 427, "keyctl": 250, "add_key": 248, "request_key": 249, "acct": 163,
               "swapon": 167, "swapoff": 168, "reboot": 169, "init_module": 175, "finit_module": 313,
               "delete_module": 176, "kexec_load": 246, "kexec_file_load": 320, "quotactl": 179,
               "iopl": 172, "ioperm": 173},
    "aarch64": {"execve": 221, "execveat": 281, "socket": 198, "ptrace": 117, "tkill": 130, "pidfd_open": 434,
                "pidfd_getfd": 438, "pidfd_send_signal": 424, "process_vm_readv": 270,
                "process_vm_writev": 271, "mount": 40, "umount2": 39, "pivot_root": 41, "chroot": 51,
                "unshare": 97, "setns": 268, "open_tree": 428, "move_mount": 429, "fsopen": 430,
                "fsconfig": 431, "fsmount": 432, "fspick": 433, "mount_setattr": 442,
                "name_to_handle_at": 264, "open_by_handle_at": 265, "bpf": 280, "perf_event_open": 241,
                "userfaultfd": 282, "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
                "keyctl": 219, "add_key": 217, "request_key": 218, "acct": 89, "swapon": 224, "swapoff": 225,
                "reboot": 142, "init_module": 105, "finit_module": 273, "delete_module": 106,
                "kexec_load": 104, "kexec_file_load": 294, "quotactl": 60},
}
_CLONE = {"x86_64": 56, "aarch64": 220}
_CLONE3 = 435
_OWN_PID_ONLY = {"x86_64": {"kill": 62, "tgkill": 234, "prlimit64": 302},
                 "aarch64": {"kill": 129, "tgkill": 131, "prlimit64": 261}}
"""Allowed only when their first argument is 0 or this process's pid (signals to itself, its own limits)."""
_CLONE_THREAD = 0x00010000
_RET_ALLOW, _RET_ERRNO, _RET_KILL = 0x7FFF0000, 0x00050000, 0x80000000
_EPERM, _ENOSYS = 1, 38
_LD_ABS, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06


def seccomp_arch() -> str | None:
    """The machine's name in the filter tables, or None where this module has no syscall table."""
    machine = os.uname().machine
    return machine if machine in _ARCH else None


def seccomp_program(arch: str, own_pid: int, allow_sockets: bool = False) -> list[tuple[int, int, int, int]]:
    """The filter as (code, jt, jf, k) instructions; jumps are resolved from labels here."""
    denied = {name: nr for name, nr in _DENIED[arch].items() if not (allow_sockets and name == "socket")}
    code: list = [(_LD_ABS, 0, 0, 4), (_JEQ, "next", "kill", _ARCH[arch]), "next", (_LD_ABS, 0, 0, 0)]
    if arch == "x86_64":
        code.append((_JGE, "eperm", 0, 0x40000000))  # the x32 ABI's numbers
    for nr in denied.values():
        code.append((_JEQ, "eperm", 0, nr))
    code.append((_JEQ, "enosys", 0, _CLONE3))
    code.append((_JEQ, "clone", 0, _CLONE[arch]))
    for nr in _OWN_PID_ONLY[arch].values():
        code.append((_JEQ, "own_pid", 0, nr))
    code += [(_RET, 0, 0, _RET_ALLOW),
             "clone", (_LD_ABS, 0, 0, 16), (_JSET, "allow", "eperm", _CLONE_THREAD),
             "own_pid", (_LD_ABS, 0, 0, 16), (_JEQ, "allow", 0, 0), (_JEQ, "allow", "eperm", own_pid),
             "allow", (_RET, 0, 0, _RET_ALLOW),
             "eperm", (_RET, 0, 0, _RET_ERRNO | _EPERM),
             "enosys", (_RET, 0, 0, _RET_ERRNO | _ENOSYS),
             "kill", (_RET, 0, 0, _RET_KILL)]
    return _assemble(code)


def _assemble(code: list) -> list[tuple[int, int, int, int]]:
    labels, position = {}, 0
    for item in code:
        if isinstance(item, str):
            labels[item] = position
        else:
            position += 1
    program = []
    for item in code:
        if isinstance(item, str):
            continue
        op, jt, jf, k = item
        here = len(program)
        jump = lambda target: target if isinstance(target, int) else labels[target] - here - 1  # noqa: E731
        program.append((op, jump(jt), jump(jf), k))
    return program


def apply_seccomp(arch: str, allow_sockets: bool = False) -> None:
    libc = _libc()
    program = seccomp_program(arch, os.getpid(), allow_sockets)
    filters = b"".join(struct.pack("=HBBI", op, jt, jf, k) for op, jt, jf, k in program)
    buffer = ctypes.create_string_buffer(filters, len(filters))
    fprog = struct.pack("=HxxxxxxQ", len(program), ctypes.addressof(buffer))
    fprog_buffer = ctypes.create_string_buffer(fprog, len(fprog))
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise _fail("prctl(NO_NEW_PRIVS)")
    if libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.addressof(fprog_buffer), 0, 0) != 0:
        raise _fail("prctl(SET_SECCOMP)")


# ---------------------------------------------------------------- identity and limits
def drop_identity(uid) -> None:
    """To `uid` (from root), or, with none given, uid 0 without any capability."""
    if uid is not None and os.getuid() == 0:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)  # from uid 0 to non-zero: the kernel clears permitted and effective capabilities
        if os.getuid() != uid or os.geteuid() != uid:
            raise OSError(f"still uid {os.getuid()} after setuid({uid})")
    elif os.geteuid() == 0:
        _drop_capabilities()


def _drop_capabilities() -> None:
    libc = _libc()
    for cap in range(64):
        if libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 and ctypes.get_errno() == 22:  # EINVAL: past the last
            break
    libc.prctl(_PR_CAP_AMBIENT, 4, 0, 0, 0)  # PR_CAP_AMBIENT_CLEAR_ALL
    header = ctypes.create_string_buffer(struct.pack("=Ii", 0x20080522, 0), 8)  # _LINUX_CAPABILITY_VERSION_3
    data = ctypes.create_string_buffer(bytes(24), 24)  # two {effective, permitted, inheritable} u32 triples
    if libc.capset(header, data) != 0:
        raise _fail("capset")


def set_limits(cfg: dict) -> None:
    def limit(name, soft, hard=None):
        resource.setrlimit(getattr(resource, name), (soft, soft if hard is None else hard))

    if cfg.get("cpu"):
        limit("RLIMIT_CPU", cfg["cpu"], cfg["cpu"] + 1)
    limit("RLIMIT_AS", cfg["mem"])
    limit("RLIMIT_FSIZE", cfg["fsize"])
    limit("RLIMIT_CORE", 0)
    limit("RLIMIT_NOFILE", 64)
    if cfg.get("nproc") and os.getuid() != 0:  # counts every process of the uid: only meaningful for our own
        limit("RLIMIT_NPROC", cfg["nproc"])


def confine(cfg: dict) -> None:
    """Applies every layer cfg asks for (see the module docstring); raises if one cannot be applied."""
    libc = _libc()
    libc.prctl(_PR_SET_PDEATHSIG, 9, 0, 0, 0)  # the parent (env rank) gone: never outlive it
    if os.getppid() == 1 and not cfg["pid_namespace"]:
        os._exit(EXIT_CONFINE_FAILED)  # it died before the line above
    for step, apply in (("identity", lambda: drop_identity(cfg["uid"])), ("rlimits", lambda: set_limits(cfg)),
                        ("landlock", lambda: cfg["landlock"] and apply_landlock(
                            cfg["landlock"], cfg["read_paths"], cfg["read_files"], cfg["write_paths"],
                            cfg["device_files"])),
                        ("seccomp", lambda: cfg["seccomp"] and apply_seccomp(cfg["seccomp"], cfg["network"]))):
        try:
            apply()
        except Exception as exc:  # report and stop: never run with less isolation than asked for
            sys.stderr.write(f"sandbox: cannot apply {step}: {type(exc).__name__}: {exc}\n")
            sys.stderr.flush()
            os._exit(EXIT_CONFINE_FAILED)
    if cfg["hook"]:
        install_audit_hook(cfg["network"])


# ---------------------------------------------------------------- the audit hook (not a boundary)
_BLOCKED_EVENTS = {"os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.system", "os.exec", "os.kill",
                   "os.killpg", "signal.pthread_kill", "subprocess.Popen", "pty.spawn", "ctypes.dlsym",
                   "ctypes.dlsym/handle", "ctypes.call_function", "ctypes.cdata", "sys.addaudithook"}
_PATH_EVENTS = {"os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.symlink",
                "os.link", "os.truncate", "os.utime", "shutil.rmtree", "shutil.move", "shutil.copyfile"}


def install_audit_hook(network: bool) -> None:
    home = os.path.realpath(os.getcwd())
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

    def inside(path):
        if isinstance(path, int):
            return True
        real = os.path.realpath(os.fsdecode(path))
        return real == home or real.startswith(home + os.sep) or real == os.devnull

    def hook(event, args):
        if event in _BLOCKED_EVENTS or (not network and event.startswith("socket.")):
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "open":
            path, mode, flags = args
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or bool((flags or 0) & write_flags)
            if writing and not inside(path):
                raise PermissionError(f"sandbox: writing outside the working dir is not allowed: {path!r}")
        elif event in _PATH_EVENTS:
            for path in args:
                if isinstance(path, (str, bytes, os.PathLike)) and not inside(path):
                    raise PermissionError(f"sandbox: {event} outside the working dir is not allowed")

    sys.addaudithook(hook)


# ---------------------------------------------------------------- what runs once confined
def run_script() -> None:
    """The python tool: main.py of the work dir as __main__. Exit status 3: out of memory, 4: an operation
    the sandbox refused (PermissionError) was the uncaught error, 1: any other error."""
    sys.argv = ["main.py"]
    with open("main.py", encoding="utf-8") as f:
        code = compile(f.read(), "main.py", "exec")
    try:
        exec(code, {"__name__": "__main__", "__builtins__": __builtins__})
    except MemoryError:
        sys.stderr.write("MemoryError: memory limit exceeded\n")
        sys.stderr.flush()
        os._exit(EXIT_MEMORY)
    except SystemExit:
        raise
    except BaseException as exc:
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_BLOCKED if isinstance(exc, PermissionError) else 1)


class Sample:
    """What the tenant function receives: the fields of marlaas_hpc.tasks.base.Sample."""

    __slots__ = ("index", "prompt", "answer", "meta")

    def __init__(self, index, prompt, answer, meta):
        self.index, self.prompt, self.answer, self.meta = index, prompt, answer, meta

    def __repr__(self):
        return f"Sample(index={self.index!r}, prompt={self.prompt!r}, answer={self.answer!r})"


def serve_function(cfg: dict) -> None:
    """A tenant function: loads cfg["source"] as module file cfg["filename"], then answers one JSON line
    per request on the original stdout ({"ok": true, "value": float} or {"ok": false, "error": ...}); the
    code's own prints go to stderr. First line: {"ok": true, "ready": true} or the loading error."""
    replies = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    function = _load_function(cfg, replies)
    for line in sys.stdin:
        try:
            request = json.loads(line)
            sample = Sample(**request["sample"])
            reply = _as_reply(function(sample, request["completion"]))
        except MemoryError:
            reply = {"ok": False, "error": f"MemoryError: memory limit of {cfg['mem'] // 2**20} MiB exceeded"}
        except BaseException as exc:  # SystemExit / KeyboardInterrupt from tenant code end the call, not us
            reply = {"ok": False, "error": _describe(exc)}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


def _as_reply(value) -> dict:
    try:
        return {"ok": True, "value": float(value)}  # bools and numpy scalars too, as float() takes them
    except (TypeError, ValueError):
        return {"ok": False, "error": f"returned {type(value).__name__} {str(value)[:80]!r}, not a number"}


def _load_function(cfg: dict, replies):
    import importlib.util

    def refuse(message):
        replies.write(json.dumps({"ok": False, "error": message}) + "\n")
        replies.flush()
        os._exit(0)

    sys.path.insert(0, os.getcwd())
    module_name = cfg["module_name"]
    try:
        spec = importlib.util.spec_from_file_location(module_name, cfg["filename"])
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
    except MemoryError:
        refuse(f"loading {cfg['display_name']} ran out of memory ({cfg['mem'] // 2**20} MiB)")
    except BaseException as exc:
        refuse(f"cannot load {cfg['display_name']}: {_describe(exc)}")
    function = getattr(module, cfg["function"], None)
    if function is None:
        refuse(f"{cfg['display_name']} has no function {cfg['function']!r}")
    if not callable(function):
        refuse(f"{cfg['display_name']}: {cfg['function']!r} is not callable")
    replies.write(json.dumps({"ok": True, "ready": True}) + "\n")
    replies.flush()
    return function


def _describe(exc: BaseException) -> str:
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename != "<string>"][-1:]
    where = f" ({os.path.basename(frames[0].filename)}:{frames[0].lineno})" if frames else ""
    return f"{type(exc).__name__}: {str(exc)[:300]}{where}"


def main(cfg: dict) -> None:
    confine(cfg)
    if cfg["mode"] == "script":
        run_script()
    else:
        serve_function(cfg)
