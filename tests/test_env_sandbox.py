"""The python tool's sandbox: runaway code is stopped within its limits and the env pool keeps serving."""
import os
import subprocess
import time

import pytest

from marlaas_hpc.env import EnvPool, EnvPoolConfig, Observation, ToolBox, ToolEnv, ToolTask
from marlaas_hpc.env.sandbox import SandboxLimits, node_isolation, run_python
from marlaas_hpc.env.tools import Python
from marlaas_hpc.tasks import Sample

LIMITS = SandboxLimits(cpu_seconds=1, wall_seconds=3.0, memory_bytes=256 * 2**20)
FORK_BOMB = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
ATTACKS = {
    "infinite_loop": ("while True: pass", "cpu_limit|timeout"),  # timeout when other load starves it of CPU
    "sleep_forever": ("import time\ntime.sleep(1000)", "timeout"),
    "allocate_10GB": ("x = bytearray(10 * 2**30)", "memory_limit"),
    "list_10GB": ("x = [0] * (10 * 2**30 // 8)", "memory_limit"),
    "fork_bomb": ("import os\nwhile True:\n    os.fork()", "blocked"),
    "subprocess": ("import subprocess\nsubprocess.run(['sh', '-c', ':(){ :|:& };:'])", "blocked"),
    "os_system": ("import os\nos.system('echo pwned')", "blocked"),
    "socket": ("import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=1)", "blocked"),
    "output_flood": ("while True: print('x' * 4096)", "output_limit"),
    "write_outside": ("open('/tmp/marlaas-sandbox-escape.txt', 'w').write('x')", "blocked"),
}


@pytest.fixture(scope="module", autouse=True)
def probed():
    """The node's isolation level is found once per process, by trial runs: not part of any attack's time."""
    node_isolation(LIMITS)


class PythonTask(ToolTask):
    kind = "python_test"

    def __init__(self, limits: SandboxLimits):
        self.tools = ToolBox([Python(limits)])

    def train_sample(self, cursor):
        return Sample(cursor, "p", "a")

    def eval_samples(self):
        return []

    def score(self, sample, completion):
        return 0.0


@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_attack_is_stopped_within_limits(name):
    code, status = ATTACKS[name]
    start = time.monotonic()
    result = run_python(code, LIMITS)
    elapsed = time.monotonic() - start
    assert result.status in status.split("|"), (result, elapsed)
    # the wall limit ended it, not a test timeout; the slack is process start and teardown on a loaded machine
    assert elapsed < LIMITS.wall_seconds + 8.0
    assert not os.path.exists("/tmp/marlaas-sandbox-escape.txt")


def test_normal_code_output_and_truncation():
    assert run_python("print(sum(range(10)))").stdout == "45\n"
    assert run_python("```python\nprint('fenced')\n```").stdout == "fenced\n"
    assert run_python("open('f.txt', 'w').write('ok')\nprint(open('f.txt').read())").stdout == "ok\n"
    long = run_python("print('y' * 5000)", SandboxLimits(max_output_chars=100))
    assert long.ok and long.stdout.startswith("y" * 100) and long.stdout.endswith("[truncated]")
    assert run_python("1/0").status == "error" and "ZeroDivisionError" in run_python("1/0").stderr_tail


def test_env_pool_keeps_serving_while_attacks_run():
    """All attacks at once through an env pool: each gets an error observation, then normal calls work."""
    task = PythonTask(LIMITS)
    with EnvPool(EnvPoolConfig(mode="thread", workers=4, step_timeout_s=20)) as pool:
        pool.add_task("py", task)
        futures = {}
        for name, (code, _) in ATTACKS.items():
            env = ToolEnv(task)
            env.reset(Sample(0, "p", "a"))
            futures[name] = pool.submit("py", env, f'<tool name="python">{code}</tool>')
        for name, future in futures.items():
            outcome = future.result(timeout=60)
            assert outcome.error is None and isinstance(outcome.result, Observation), name
            assert outcome.result.tool_errors == 1 and outcome.result.text.startswith("<result>error: "), name
        env = ToolEnv(task)
        env.reset(Sample(0, "p", "a"))
        ok = pool.step("py", env, '<tool name="python">print(6 * 7)</tool>')
        assert ok.result.text == "<result>42</result>\n" and ok.result.tool_errors == 0
        assert pool.stats()["stages"]["tool:python"]["count"] == len(ATTACKS) + 1


@pytest.mark.skipif(os.getuid() != 0, reason="running each call as its own uid needs root")
def test_kernel_process_cap_holds_without_the_audit_hook():
    """With the audit hook off, a fork bomb run as its own uid gets no process (seccomp; RLIMIT_NPROC behind it)
    and nothing of it is left running."""
    uid_range = (61500, 61510)
    limits = SandboxLimits(cpu_seconds=1, wall_seconds=2.0, max_processes=8, uid_range=uid_range, audit_hook=False)
    start = time.monotonic()
    result = run_python(FORK_BOMB, limits)
    # the 2 s wall limit ended it (slack: start and teardown of the bomb's processes on a loaded machine)
    assert result.status in ("timeout", "cpu_limit") and time.monotonic() - start < limits.wall_seconds + 8.0
    ps = subprocess.run(["ps", "-eo", "uid=,stat="], capture_output=True, text=True).stdout.split("\n")
    alive = [line for line in ps if line.split() and uid_range[0] <= int(line.split()[0]) < uid_range[1]
             and not line.split()[1].startswith("Z")]
    assert alive == []


def test_network_is_refused_without_the_audit_hook():
    """No socket at all (seccomp: EPERM), on top of the empty network namespace where the node allows one."""
    code = "import socket\ntry:\n    socket.create_connection(('1.1.1.1', 80), timeout=2)\nexcept OSError as e:\n" \
           "    print(type(e).__name__, e.errno)"
    result = run_python(code, SandboxLimits(audit_hook=False))
    assert result.ok and result.stdout.startswith("PermissionError 1"), result
