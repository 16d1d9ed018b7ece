"""Tenant identity with two real Unix users: `marlaas tasks add/cancel` run as each of them against a run dir on a
shared filesystem, and rank 0's side of the queue (QueueIntake, as the job's owner) checks every queued spec's
tenant against the uid that owns its file. A user may add tasks only as a tenant that is theirs (their user
name, or one the job config maps to them or their group), cancel only their own tasks; the job's owner may do
both for anyone. Hand-written queue files cannot bypass the CLI's checks. Needs root (useradd, runuser)."""
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from marlaas_hpc.config import JobConfig
from marlaas_hpc.scheduler import Scheduler, SchedulerConfig, Submit
from marlaas_hpc.service import QueueIntake
from support.unix_users import SKIP_REASON, can_make_users, run_as, unix_users

ROOT = Path(__file__).resolve().parents[1]
ALICE, BOB, LAB = "mlsalice", "mlsbob", "mlslab"

pytestmark = pytest.mark.skipif(not can_make_users(), reason=SKIP_REASON)


@pytest.fixture(scope="module")
def users():
    """Two throw-away users (alice in group mlslab), removed afterwards."""
    with unix_users([ALICE, BOB], {LAB: [ALICE]}) as uids:
        yield uids


def marlaas_as(user: str, *args) -> subprocess.CompletedProcess:
    env = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HOME": "/tmp"}
    return run_as(user, [sys.executable, "-m", "marlaas_hpc.cli", *map(str, args)], env)


def write_as(user: str, path: Path, text: str) -> None:
    """A file written by `user` directly (not through the CLI): its owner is who wrote it."""
    code = f"import os; p = {str(path)!r}; open(p + '.tmp', 'w').write({text!r}); os.rename(p + '.tmp', p)"
    proc = run_as(user, [sys.executable, "-c", code], {})
    assert proc.returncode == 0, proc.stderr


@pytest.fixture(scope="module")
def shared(users):
    """A run dir on a 'shared filesystem' every user can reach, a job owned by root, and the users' specs."""
    top = Path(tempfile.mkdtemp(prefix="marlaas-tenants-", dir="/tmp"))
    top.chmod(0o755)
    specs = top / "specs"
    specs.mkdir()
    specs.chmod(0o755)
    job = JobConfig.from_dict({"model": "tiny", "data_roots": [str(specs)], "tenants": {"lab": {"groups": [LAB]}},
                               "sandbox": {"reward_timeout_s": 10}})
    intake = QueueIntake(job, top / "run")
    scheduler = Scheduler(SchedulerConfig(rollout_ranks=(1,), env_ranks=(2,)), clock=time.time)
    yield {"top": top, "specs": specs, "run": top / "run", "intake": intake, "scheduler": scheduler}
    shutil.rmtree(top, ignore_errors=True)


def spec_file(shared, name: str, **fields) -> Path:
    spec = {"task_id": name, "total_steps": 2, "dataset": {"kind": "addition", "eval_size": 4}, **fields}
    path = shared["specs"] / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    path.chmod(0o644)
    return path


def admit(shared) -> dict[str, str | None]:
    """Rank 0's intake pass: takes every queued file, submits the accepted specs; task/file -> refusal or None."""
    intake, scheduler = shared["intake"], shared["scheduler"]
    out = {}
    for entry, spec, reason in intake.take(scheduler.tasks):
        if spec is not None:
            scheduler.handle(Submit(spec))
        intake.settle(entry, reason)
        out[spec.task_id if spec is not None else entry.data["spec"]["task_id"]] = reason
    return out


def test_two_users_add_and_cancel_only_their_own(shared, users):
    run = shared["run"]
    assert (run / "queue").stat().st_mode & 0o1777 == 0o1777, "sticky and world-writable, like /tmp"
    # alice adds her own task, with a reward file next to her spec, and one of her group's tenant
    (shared["specs"] / "alice_reward.py").write_text("def score(sample, completion):\n    return 1.0\n")
    alice_spec = spec_file(shared, "a1", tenant=ALICE,
                           dataset={"kind": "custom", "path": "data.jsonl", "reward_fn": "alice_reward.py:score"})
    (shared["specs"] / "data.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    for path in shared["specs"].iterdir():
        path.chmod(0o644)
    proc = marlaas_as(ALICE, "tasks", "add", alice_spec, "--run", run)
    assert proc.returncode == 0, proc.stderr
    proc = marlaas_as(ALICE, "tasks", "add", spec_file(shared, "lab1", tenant="lab"), "--run", run)
    assert proc.returncode == 0, proc.stderr
    # bob may not add as alice or as a group he is not in; without a tenant, his task is his own
    for name, tenant in (("b_as_alice", ALICE), ("b_as_lab", "lab")):
        proc = marlaas_as(BOB, "tasks", "add", spec_file(shared, name, tenant=tenant), "--run", run)
        assert proc.returncode == 2 and f"may not add tasks as tenant '{tenant}'" in proc.stderr, proc.stderr
        assert "nothing queued" in proc.stderr
    proc = marlaas_as(BOB, "tasks", "add", spec_file(shared, "b1"), "--run", run)
    assert proc.returncode == 0 and f"tenant '{BOB}'" in proc.stdout, proc.stderr
    # bob bypasses the CLI and writes a queue file naming alice: rank 0 checks the file's owner itself
    forged = {"spec": {"task_id": "forged", "tenant": ALICE, "total_steps": 2,
                       "dataset": {"kind": "addition", "eval_size": 4}}, "added_at": time.time()}
    write_as(BOB, run / "queue" / f"{time.time_ns():020d}-forged.json", json.dumps(forged))
    owners = {p.name.split("-", 1)[1]: p.stat().st_uid for p in (run / "queue").glob("*.json")}
    assert owners == {"a1.json": users[ALICE], "lab1.json": users[ALICE], "b1.json": users[BOB],
                      "forged.json": users[BOB]}
    decided = admit(shared)
    assert decided["a1"] is None and decided["lab1"] is None and decided["b1"] is None, decided
    assert f"user '{BOB}' (uid {users[BOB]}) may not add tasks as tenant '{ALICE}'" in decided["forged"]
    tasks = shared["scheduler"].tasks
    assert tasks["a1"].spec.tenant == ALICE and tasks["b1"].spec.tenant == BOB and "forged" not in tasks
    assert tasks["a1"].spec.dataset.reward_fn == f"{shared['specs'] / 'alice_reward.py'}:score"

    # cancel: bob may not cancel alice's task, neither through the CLI nor with a hand-made request
    proc = marlaas_as(BOB, "tasks", "cancel", "a1", "--run", run)
    assert proc.returncode == 2 and f"may not cancel tasks of tenant '{ALICE}'" in proc.stderr, proc.stderr
    write_as(BOB, run / "queue" / "cancel" / f"a1@{time.time_ns()}", "{}")
    refused = shared["intake"].cancels(tasks)
    assert [t for t, _ in refused] == ["a1"] and f"user '{BOB}'" in refused[0][1], refused
    # alice cancels hers (and her group's), the job's owner cancels bob's
    for user, task_id in ((ALICE, "a1"), (ALICE, "lab1"), ("root", "b1")):
        proc = marlaas_as(user, "tasks", "cancel", task_id, "--run", run)
        assert proc.returncode == 0, (user, task_id, proc.stderr)
    allowed = shared["intake"].cancels(tasks)
    assert sorted(allowed) == [("a1", None), ("b1", None), ("lab1", None)], allowed
    assert list((run / "queue" / "cancel").glob("*@*")) == [], "every request was taken"

    # only the job's owner may close the job; a CLOSE marker written by anyone else is ignored
    proc = marlaas_as(BOB, "tasks", "close", "--run", run)
    assert proc.returncode == 2 and "only the job's owner" in proc.stderr, proc.stderr
    write_as(BOB, run / "queue" / "CLOSE", "{}")
    shared["intake"].next_poll = 0.0
    assert shared["intake"].due() and not shared["intake"].closed
    (run / "queue" / "CLOSE").unlink()
    assert marlaas_as("root", "tasks", "close", "--run", run).returncode == 0
    shared["intake"].next_poll = 0.0
    assert shared["intake"].due() and shared["intake"].closed
