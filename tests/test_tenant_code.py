"""Tenant reward files in the env pool, with real sandboxed worker processes: a function that raises, hangs, eats
memory, ends its process or answers nonsense fails its own task only (thread and process pools); good tasks go
on scoring meanwhile. Intake checks a file by loading it in a sandboxed worker, never in this process."""
import json
import os
import sys
import pytest

from marlaas_hpc.env import EnvPool, EnvPoolConfig, SingleTurnEnv
from marlaas_hpc.env.tenant_code import SandboxConfig, TenantFunction, check_reward_code
from marlaas_hpc.env import build_task_data
from marlaas_hpc.tasks import DatasetSpec, SpecError

REWARDS = '''
import os, time
def exact(sample, completion):
    return float(completion.strip() == sample.answer)
def raises(sample, completion):
    raise KeyError("no such answer")
def hangs(sample, completion):
    while True:
        pass
def sleeps(sample, completion):
    time.sleep(3600)
def eats_memory(sample, completion):
    hoard = []
    while True:
        hoard.append(bytearray(64 * 2**20))
def exits(sample, completion):
    os._exit(0)
def words(sample, completion):
    return "full marks"
def floods(sample, completion):
    while True:
        print("x" * 65536)
'''
FAULTS = {"raises": "KeyError: 'no such answer'", "hangs": "did not return within 3 s",
          "sleeps": "did not return within 3 s", "eats_memory": "MemoryError: memory limit of 256 MiB exceeded",
          "exits": "worker process ended", "words": "not a number", "floods": "File too large"}
CONFIG = SandboxConfig(reward_timeout_s=3.0, reward_memory_mb=256)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tenant")
    (tmp / "rewards.py").write_text(REWARDS)
    data = tmp / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(20)))
    return tmp, data


def task(files, function):
    tmp, data = files
    return build_task_data(DatasetSpec(kind="custom", path=str(data), reward_fn=f"{tmp / 'rewards.py'}:{function}",
                                       eval_size=2), sandbox=CONFIG)


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_faulty_tenant_functions_fail_their_own_task_only(files, mode):
    tasks = {"good": task(files, "exact"), **{name: task(files, name) for name in FAULTS}}
    with EnvPool(EnvPoolConfig(mode=mode, workers=4, step_timeout_s=60)) as pool:
        for name, data in tasks.items():
            pool.add_task(name, data)
        futures = {}
        for name, data in tasks.items():
            for i in range(2):
                env = SingleTurnEnv(data)
                sample = data.train_sample(i)
                env.reset(sample)
                futures[(name, i)] = pool.submit(name, env, sample.answer)
        outcomes = {key: future.result(timeout=300) for key, future in futures.items()}
    for i in range(2):
        good = outcomes[("good", i)]
        assert good.error is None and good.result.reward == 1.0, good
    for name, says in FAULTS.items():
        for i in range(2):
            outcome = outcomes[(name, i)]
            assert outcome.error is not None and outcome.error.cause == "reward", (name, outcome)
            assert says in str(outcome.error) and f"rewards.py:{name}" in str(outcome.error), (name, outcome.error)


def test_reward_file_never_runs_in_the_caller(files, tmp_path):
    """Building the task (CLI, rank 0) reads the file; only a sandboxed worker executes it."""
    marker = tmp_path / "ran-here"
    (tmp_path / "loud.py").write_text(f"try:\n    open({str(marker)!r}, 'w').write('here')\nexcept OSError:\n"
                                      "    pass\ndef score(sample, completion):\n    return 1.0\n")
    _, data = files
    spec = DatasetSpec(kind="custom", path=str(data), reward_fn=f"{tmp_path / 'loud.py'}:score")
    built = build_task_data(spec, sandbox=CONFIG)
    assert not marker.exists() and "loud" not in sys.modules
    check_reward_code(spec, CONFIG)  # the sandboxed worker runs it, and may not write outside its work dir
    assert not marker.exists()
    sample = built.train_sample(0)
    assert built.reward(sample, "anything") == 1.0


@pytest.mark.parametrize("source, says", [
    ("def score(sample, completion:\n    return 1\n", "SyntaxError"),
    ("import no_such_module_here\ndef score(s, c):\n    return 1\n", "ModuleNotFoundError"),
    ("def other(s, c):\n    return 1\n", "has no function 'score'"),
    ("score = 3\n", "is not callable"),
    ("raise SystemExit('bye')\n", "SystemExit: bye"),
    ("import socket\nsocket.create_connection(('127.0.0.1', 22))\n", "PermissionError"),
    ("x = bytearray(8 * 2**30)\ndef score(s, c):\n    return 1\n", "ran out of memory"),
])
def test_intake_check_refuses_what_cannot_load(files, tmp_path, source, says):
    (tmp_path / "r.py").write_text(source)
    _, data = files
    spec = DatasetSpec(kind="custom", path=str(data), reward_fn=f"{tmp_path / 'r.py'}:score")
    with pytest.raises(SpecError) as err:
        check_reward_code(spec, CONFIG)
    assert err.value.field == "dataset.reward_fn" and says in str(err.value), str(err.value)


def test_worker_restarts_after_a_failure_and_stops_when_idle(files):
    """A task's later calls get a fresh worker (its task is failed by then, but e.g. an eval may still score);
    an idle worker is stopped by the reaper."""
    tmp, data = files
    (tmp / "flaky.py").write_text("import os\ncalls = []\ndef score(sample, completion):\n"
                                  "    calls.append(1)\n    if completion == 'die':\n        os._exit(1)\n"
                                  "    return len(calls) / 10\n")
    built = build_task_data(DatasetSpec(kind="custom", path=str(data), reward_fn=f"{tmp / 'flaky.py'}:score"),
                            sandbox=CONFIG)
    function = built._reward_fn
    assert isinstance(function, TenantFunction)
    sample = built.train_sample(0)
    assert [built.reward(sample, "a"), built.reward(sample, "a")] == [0.1, 0.2]  # one worker keeps its state
    with pytest.raises(Exception, match="worker process ended"):
        built.reward(sample, "die")
    assert built.reward(sample, "a") == 0.1, "a fresh worker"
    pid = function._worker.proc.pid
    function.stop_if_idle(60.0)
    assert function._worker.proc is not None, "not idle long enough"
    function.stop_if_idle(0.0)
    assert function._worker.proc is None and not os.path.exists(f"/proc/{pid}")
    assert built.reward(sample, "a") == 0.1, "started again on the next call"
    function.close()
