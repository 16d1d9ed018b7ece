"""The sandbox holds without the Python audit hook: model-written code (the python tool) and tenant code (a reward
file) try to read /etc/shadow, another tenant's adapter and the job's run dir, to write outside their work dir,
to spawn, to connect (TCP and unix sockets), to signal the env rank, to make namespaces -- on every isolation
level this node offers, with the audit hook off. Every attempt must fail and leave no trace; the code's own
work dir, its task's data file, the interpreter and threads keep working."""
import json
import os
import shutil
import socket
import sys
import tempfile
import threading
from pathlib import Path

import pytest

from marlaas_hpc.env.sandbox import LEVELS, SandboxLimits, SandboxUnavailable, node_isolation, run_python
from marlaas_hpc.env.tenant_code import CodeRef, SandboxConfig, TenantFunction
from marlaas_hpc.tasks.base import RewardError, Sample
from support.unix_users import SKIP_REASON, can_make_users, run_as, unix_users

SECRET = "marlaas-test-secret-7b1e"

# One attempt per entry: Python statements that succeed only if the sandbox leaks. {placeholders} are filled in.
ATTACKS = {
    "read /etc/shadow": "open('/etc/shadow').read()",
    "read another tenant's adapter": "open({adapter!r}, 'rb').read()",
    "list the run dir": "assert os.listdir({run_dir!r}) is not None",
    "read the run dir's job.json": "open({job_json!r}).read()",
    "read the env rank's environment": "assert {secret!r} in open(f'/proc/{{os.getppid()}}/environ').read()",
    "read a /proc environ": "assert any({secret!r} in open(f'/proc/{{p}}/environ').read() "
                            "for p in os.listdir('/proc') if p.isdigit())",
    "write outside (/tmp)": "open({outside_tmp!r}, 'w').write('x')",
    "write into the run dir": "open({outside_run!r}, 'w').write('x')",
    "spawn a program": "import subprocess, sys; subprocess.run([sys.executable, '-c', 'pass'], check=True)",
    "posix_spawn": "import sys; os.waitpid(os.posix_spawn(sys.executable, ['python', '-c', 'pass'], {{}}), 0)",
    "fork": "pid = os.fork()\nif pid == 0: os._exit(0)\nos.waitpid(pid, 0)",
    "connect over TCP": "import socket; socket.create_connection(('127.0.0.1', {tcp_port}), timeout=2).close()",
    "connect to a unix socket": "import socket; s = socket.socket(socket.AF_UNIX); s.connect({unix_path!r})",
    "signal the env rank": "os.kill(os.getppid(), 0)",
    "signal the test process": "os.kill({parent}, 0)",
    "new user namespace": "import ctypes; assert ctypes.CDLL(None).unshare(0x10000000) == 0",
    "setuid back to root": "os.setuid(0); assert os.getuid() == 0; open('/etc/shadow').read()",
}


@pytest.fixture(scope="module")
def world():
    """A job's run dir with two tenants' outputs, a listening TCP and unix socket, and a secret in our env; all
    of it readable to anyone (0755 / 0644), so that only the sandbox can refuse."""
    tmp = Path(tempfile.mkdtemp(prefix="marlaas-escape-", dir="/tmp"))
    run_dir = tmp / "run"
    adapter = run_dir / "tasks" / "bob" / "t2" / "adapters" / "v0001" / "adapter_model.safetensors"
    adapter.parent.mkdir(parents=True)
    adapter.write_bytes(b"bob's weights")
    (run_dir / "job.json").write_text("{}")
    data = tmp / "alice" / "data.jsonl"
    data.parent.mkdir()
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    for path in tmp.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)
    tmp.chmod(0o755)
    tcp = socket.create_server(("127.0.0.1", 0))
    unix_path = str(tmp / "svc.sock")
    unix = socket.socket(socket.AF_UNIX)
    unix.bind(unix_path)
    unix.listen()
    os.chmod(unix_path, 0o777)
    accepted = []
    for server in (tcp, unix):
        server.settimeout(0.2)
        threading.Thread(target=_accept, args=(server, accepted), daemon=True).start()
    os.environ["MARLAAS_TEST_SECRET"] = SECRET
    values = {"adapter": str(adapter), "run_dir": str(run_dir), "job_json": str(run_dir / "job.json"),
              "secret": SECRET, "parent": os.getpid(), "outside_tmp": f"/tmp/marlaas-escape-{os.getpid()}",
              "outside_run": str(run_dir / "escaped"), "tcp_port": tcp.getsockname()[1], "unix_path": unix_path}
    yield {"values": values, "data": str(data), "accepted": accepted, "tmp": tmp}
    del os.environ["MARLAAS_TEST_SECRET"]
    tcp.close()
    unix.close()
    Path(values["outside_tmp"]).unlink(missing_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)


def _accept(server, accepted):
    while True:
        try:
            accepted.append(server.accept())
        except socket.timeout:
            continue
        except OSError:
            return


def _levels():
    """(level, uid_range) cases: each level this node offers, as the sandbox uid and, as root, as a uid 0
    stripped of capabilities (the landlock level's fallback when the sandbox uid cannot read the interpreter)."""
    cases = []
    for level in LEVELS[:2]:
        for uid_range in ((SandboxLimits().uid_range, None) if os.geteuid() == 0 else (None,)):
            cases.append(pytest.param(level, uid_range, id=f"{level}-{'uid_range' if uid_range else 'no uid_range'}"))
    return cases


def _limits(level, uid_range, **over):
    limits = SandboxLimits(isolation=level, uid_range=uid_range, audit_hook=False, wall_seconds=60,
                           cpu_seconds=30, max_output_chars=20000, **over)
    try:
        node_isolation(limits)
    except SandboxUnavailable as exc:
        pytest.skip(f"isolation level {level!r} is not available on this node: {exc}")
    return limits


def _probe_script(values) -> str:
    """One script trying every attack in turn; prints {attack: 'refused: <error>' | 'LEAKED'} as JSON."""
    lines = ["import json, os", "out = {}"]
    for name, code in ATTACKS.items():
        body = "\n".join("    " + line for line in code.format(**values).splitlines())
        lines += ["try:", body, f"    out[{name!r}] = 'LEAKED'",
                  "except BaseException as exc:", f"    out[{name!r}] = f'refused: {{type(exc).__name__}}: {{exc}}'"]
    lines.append("print(json.dumps(out))")
    return "\n".join(lines)


def _assert_no_trace(world):
    assert not Path(world["values"]["outside_tmp"]).exists()
    assert not Path(world["values"]["outside_run"]).exists()
    assert world["accepted"] == [], "a connection reached a server outside the sandbox"


@pytest.mark.parametrize("level, uid_range", _levels())
def test_model_code_cannot_escape(world, level, uid_range):
    limits = _limits(level, uid_range)
    result = run_python(_probe_script(world["values"]), limits)
    assert result.ok, result
    outcomes = json.loads(result.stdout)
    leaked = {name: outcome for name, outcome in outcomes.items() if not outcome.startswith("refused")}
    assert leaked == {}, f"{node_isolation(limits).describe()}: {leaked}"
    assert set(outcomes) == set(ATTACKS)
    _assert_no_trace(world)
    adapter = outcomes["read another tenant's adapter"]
    print(f"\n[sandbox] {node_isolation(limits).describe()}: all {len(ATTACKS)} attempts refused; e.g. "
          f"/etc/shadow -> {outcomes['read /etc/shadow']}; adapter -> {adapter}")


@pytest.mark.skipif(not can_make_users(), reason=SKIP_REASON)
@pytest.mark.parametrize("level", LEVELS[:2])
def test_model_code_cannot_escape_under_a_normal_user(world, level):
    """A job run by a normal user (as on a Slurm compute node): no root, no uid change; the same attempts fail
    (bwrap then runs in a user namespace)."""
    runner = ("import json, sys\nfrom marlaas_hpc.env.sandbox import SandboxLimits, SandboxUnavailable, "
              "node_isolation, run_python\n"
              f"limits = SandboxLimits(isolation={level!r}, audit_hook=False, wall_seconds=60, cpu_seconds=30, "
              "max_output_chars=20000)\n"
              "try:\n    node_isolation(limits)\nexcept SandboxUnavailable as exc:\n"
              "    print(json.dumps({'unavailable': str(exc)})); sys.exit(0)\n"
              f"result = run_python({_probe_script(world['values'])!r}, limits)\n"
              "print(json.dumps({'level': node_isolation(limits).describe(), 'status': result.status, "
              "'stdout': result.stdout, 'stderr': result.stderr_tail}))\n")
    with unix_users(["mlscarol"]):
        proc = run_as("mlscarol", [sys.executable, "-c", runner],
                      {"PYTHONPATH": str(Path(__file__).resolve().parents[1]), "MARLAAS_TEST_SECRET": SECRET})
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    if "unavailable" in report:
        pytest.skip(f"level {level!r} is not available to a normal user here: {report['unavailable']}")
    assert report["status"] == "ok", report
    outcomes = json.loads(report["stdout"])
    leaked = {name: outcome for name, outcome in outcomes.items() if not outcome.startswith("refused")}
    assert leaked == {} and set(outcomes) == set(ATTACKS), (report["level"], leaked)
    _assert_no_trace(world)
    print(f"\n[sandbox] as a normal user, {report['level']}: all {len(ATTACKS)} attempts refused")


@pytest.mark.parametrize("level, uid_range", _levels())
def test_model_code_keeps_what_it_needs(level, uid_range):
    code = ("import json, threading, numpy\nopen('out.txt', 'w').write('ok')\nt = threading.Thread(target=print, "
            "args=('thread',))\nt.start(); t.join()\nprint(open('out.txt').read(), int(numpy.arange(4).sum()))")
    result = run_python(code, _limits(level, uid_range))
    assert result.ok and result.stdout == "thread\nok 6\n", result


def _reward_file(tmp: Path, values) -> Path:
    """A tenant's reward function that performs the attack named by the sample: 1.0 if it got through."""
    lines = ["import os", "def attempt(sample, completion):", "    name = sample.meta['attack']",
             "    if name == 'own data':", "        return float('answer' in open(sample.meta['data']).read())"]
    for name, code in ATTACKS.items():
        body = "\n".join("            " + line for line in code.format(**values).splitlines())
        lines += [f"    if name == {name!r}:", "        try:", body, "        except (OSError, AssertionError):",
                  "            return 0.0", "        return 1.0"]
    path = tmp / f"reward_{os.getpid()}.py"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("level, uid_range", _levels())
def test_tenant_code_cannot_escape(world, level, uid_range):
    limits = _limits(level, uid_range)
    function = TenantFunction(CodeRef("attempt", path=str(_reward_file(world["tmp"], world["values"]))), limits,
                              read_files=(world["data"],))
    try:
        assert function(Sample(0, "p", "a", {"attack": "own data", "data": world["data"]}), "") == 1.0
        got_through = [name for name in ATTACKS
                       if function(Sample(0, "p", "a", {"attack": name}), "") != 0.0]
    finally:
        function.close()
    assert got_through == [], node_isolation(limits).describe()
    _assert_no_trace(world)


def test_unisolated_level_is_refused_for_tenant_code(world):
    """Where only rlimits are left (no bubblewrap, no Landlock), tenant code does not run unless the job says so."""
    path = world["tmp"] / "plain_reward.py"
    path.write_text("def one(sample, completion):\n    return 1.0\n")
    config = SandboxConfig(isolation="rlimits")
    function = TenantFunction(CodeRef("one", path=str(path)), config.reward_limits())
    with pytest.raises(RewardError, match="no file isolation"):
        function(Sample(0, "p", "a"), "")
    allowed = TenantFunction(CodeRef("one", path=str(path)),
                             SandboxConfig(isolation="rlimits", allow_unisolated=True).reward_limits())
    try:
        assert allowed(Sample(0, "p", "a"), "") == 1.0
    finally:
        allowed.close()


def test_rlimits_level_is_no_file_boundary_but_still_refuses_processes_and_network(world):
    """What the last level guarantees, shown by the same probe (and proof that the probe can see a leak): files
    its uid may read are readable, but spawning, connecting and signalling stay refused (seccomp)."""
    limits = SandboxLimits(isolation="rlimits", allow_unisolated=True, audit_hook=False, wall_seconds=60,
                           cpu_seconds=30, max_output_chars=20000)
    result = run_python(_probe_script(world["values"]), limits)
    assert result.ok, result
    outcomes = json.loads(result.stdout)
    assert outcomes["read another tenant's adapter"] == "LEAKED"
    assert outcomes["list the run dir"] == "LEAKED"
    for name in ("spawn a program", "posix_spawn", "fork", "connect over TCP", "connect to a unix socket",
                 "signal the env rank", "signal the test process", "new user namespace"):
        assert outcomes[name].startswith("refused"), (name, outcomes[name])
    Path(world["values"]["outside_run"]).unlink(missing_ok=True)
    Path(world["values"]["outside_tmp"]).unlink(missing_ok=True)


def test_this_node_offers_file_isolation():
    """Tenant code is refused where only rlimits are left; a CI or cluster node must offer bubblewrap or Landlock."""
    isolation = node_isolation(SandboxLimits())
    assert isolation.level in ("bwrap", "landlock"), (
        f"no file isolation here ({'; '.join(isolation.notes)}): install bubblewrap (tools/setup_env.sh does, as "
        "root) or run on Linux >= 5.13 with Landlock enabled")
    print(f"\n[sandbox] this node: {isolation.describe()}")
