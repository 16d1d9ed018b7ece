"""Helpers for tests that act as real Unix users (root only): create throw-away users, run commands as them."""
import os
import pwd
import shutil
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest

TOOLS = ("useradd", "userdel", "groupadd", "groupdel", "runuser", "setpriv")
SKIP_REASON = "acting as other Unix users needs root and useradd/userdel/groupadd/runuser/setpriv"


def can_make_users() -> bool:
    return os.geteuid() == 0 and all(shutil.which(tool) for tool in TOOLS)


@contextmanager
def unix_users(names: list[str], groups: dict[str, list[str]] | None = None):
    """Creates the users (no home, no shell) and groups {group: [members]}; removes them afterwards."""
    created = []
    try:
        for group in groups or {}:
            subprocess.run(["groupadd", group], check=True, capture_output=True)
            created.append(("groupdel", group))
        for name in names:
            member_of = [g for g, members in (groups or {}).items() if name in members]
            subprocess.run(["useradd", "-M", "-s", "/usr/sbin/nologin"] + (["-G", ",".join(member_of)] if member_of
                                                                            else []) + [name],
                           check=True, capture_output=True)
            created.append(("userdel", name))
        yield {name: pwd.getpwnam(name).pw_uid for name in names}
    finally:
        for tool, name in reversed(created):
            subprocess.run([tool, name], capture_output=True)


def as_user(user: str, argv: list[str]) -> list[str]:
    """argv run as `user`. Where that user cannot reach the interpreter (it may lie under a 0700 /root), a
    privileged bubblewrap shows them the same filesystem with only the interpreter's hidden ancestor replaced by
    a 0755 tmpfs holding the interpreter; everything they write lands on the real filesystem, owned by them."""
    plain = [shutil.which("runuser"), "-u", user, "--"]
    probe = subprocess.run(plain + [sys.executable, "-c", "import yaml"], capture_output=True, cwd="/")
    if probe.returncode == 0:
        return plain + argv
    prefix = os.path.realpath(sys.base_prefix)
    hidden = _hidden_ancestor(user, prefix)
    if hidden is None or shutil.which("bwrap") is None:
        pytest.skip(f"user {user} cannot run {sys.executable} and bubblewrap is not there to show it to them")
    dirs = []
    for parent in reversed(Path(prefix).parents):
        if len(str(parent)) > len(hidden):
            dirs += ["--perms", "0755", "--dir", str(parent)]
    return [shutil.which("bwrap"), "--dev-bind", "/", "/", "--perms", "0755", "--tmpfs", hidden, *dirs,
            "--ro-bind", prefix, prefix, "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID",
            shutil.which("setpriv"), f"--reuid={user}", f"--regid={user}", "--init-groups", "--"] + argv


def _hidden_ancestor(user: str, prefix: str) -> str | None:
    uid = pwd.getpwnam(user).pw_uid
    for parent in reversed(Path(prefix).parents):
        info = parent.stat()
        if info.st_uid != uid and not info.st_mode & 0o001:
            return str(parent)
    return None


def run_as(user: str, argv: list[str], env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    """argv as `user` with exactly `env` (plus PATH), from /."""
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", **env}
    return subprocess.run(["env", "-i", *(f"{k}={v}" for k, v in env.items())] + as_user(user, argv), cwd="/",
                          capture_output=True, text=True, timeout=timeout)
