"""A TP=2 trainer group agrees before it goes on (issue #36 item 3; runtime/group_guard.py): an out-of-memory
error on one rank in the middle of a fused step (between two TP collectives, or after one task's optimizer step
with the other's collective pending on the peer) ends the step on both ranks, which make their process groups
again and redo it from the tasks' snapshot: the adapters come out exactly as without the fault. The same error on
both ranks is a task's fault: raised on both, the tasks as before the step. Two gloo processes
(tests/support/group_guard_scenarios.py). How each outcome is settled, on a world of one (no vote to wait for)."""
from __future__ import annotations

import pytest
import torch

from support.group_guard_scenarios import FAULTS, STEP_TASKS, STEPS, faults_scenario, nccl_watch_scenario

SLOW = pytest.mark.slow  # two processes of megatron imports


@pytest.fixture(scope="module")
def records(tiny_model_path):
    from support.local_group import run_local

    return run_local(faults_scenario, 2, str(tiny_model_path), timeout=300)


@SLOW
def test_a_step_failed_on_one_rank_is_redone_on_both_and_trains_as_if_it_had_not(records):
    for record in records:
        for reference, faulted in zip(record["reference"], record["faulted"]):
            for task_id in STEP_TASKS:
                assert faulted["metrics"][task_id]["loss"] == reference[task_id]["loss"]
                assert faulted["metrics"][task_id]["grad_norm"] == reference[task_id]["grad_norm"]
        for task_id in STEP_TASKS:
            for key, value in record["reference_tensors"][task_id].items():
                assert torch.equal(record["faulted_tensors"][task_id][key], value), (task_id, key)
        assert record["versions"] == {t: STEPS for t in STEP_TASKS}
        assert max(step["seconds"] for step in record["faulted"]) < 60, "no rank waited out a timeout"


@SLOW
def test_each_failure_is_settled_alike_on_both_ranks(records):
    first, second = records
    assert first["regroups"] == second["regroups"]
    outcomes = [(r["attempt"], r["kinds"], r["outcome"]) for r in first["regroups"]]
    assert outcomes == [(1, {"0": "peer", "1": "rank"}, "again"),  # rank 1's OOM in the forward
                        (1, {"0": "rank", "1": "peer"}, "again"),  # rank 0's in b's grad norm
                        (1, {"0": "task", "1": "task"}, "task fault")]
    assert "OutOfMemoryError" in first["regroups"][0]["failed"]["1"]
    assert "Connection closed by peer" in first["regroups"][0]["failed"]["0"], "rank 0 was freed by the take-down"
    assert all(r["left_open"] == [] for r in first["regroups"]), "every group was freed"
    assert first["group_epoch"] == second["group_epoch"] == len(FAULTS)


@SLOW
def test_the_same_error_on_both_ranks_is_the_tasks_fault_and_leaves_them_as_before(records):
    for record in records:
        (step, raised), = record["raised"].items()
        assert FAULTS[step][0] == "task"
        assert raised["stage"] == "train" and raised["reason"] == "ValueError: injected: this batch cannot be trained"
        assert raised["restored"] and raised["versions"] == {t: step for t in STEP_TASKS}


@SLOW
@pytest.mark.parametrize("watch", [True, False])
def test_on_nccl_a_peers_alarm_aborts_the_collective_this_rank_waits_in(watch):
    """NCCL never fails a collective whose peer left it: the guard's watcher (on for NCCL) aborts this rank's groups
    as soon as the peer's alarm is in the store. Without it the collective stays pending (here until the stand-in's
    15 s; on NCCL until the watchdog ends the process) and its unsound result would have been voted 'ok'."""
    from support.local_group import run_local

    waiting, failing = run_local(nccl_watch_scenario, 2, watch, timeout=120)
    assert failing["attempts"] == 2 and failing["events"] == ["taken down", "made again", "restored"]
    if watch:
        assert waiting["result"] == "done" and waiting["attempts"] == 2 and waiting["seconds"] < 10
        assert waiting["events"] == ["aborted by the watcher", "taken down", "made again", "restored"]
        assert waiting["regroups"][0]["kinds"] == {"0": "peer", "1": "rank"}
    else:
        assert waiting["seconds"] >= 15 and "aborted by the watcher" not in waiting["events"]


class _OneRankTrainer:
    """What GroupGuard uses of a trainer, in a world of one: the task state is a counter it restores."""

    group_rank, group_size, group_store, control_group, backend = 0, 1, None, None, "gloo"

    def __init__(self):
        self.state, self.restored = 0, 0

    def snapshot(self, task_ids):
        return self.state

    def restore(self, snapshot):
        self.state, self.restored = snapshot, self.restored + 1


@pytest.mark.parametrize("error, raised", [
    (lambda: torch.OutOfMemoryError("CUDA out of memory"), "GroupGaveUp"),
    (lambda: ValueError("a bad batch"), "TaskFault"),
    (lambda: OSError(28, "No space left on device"), "OSError"),
    (lambda: RuntimeError("Connection closed by peer [10.0.0.2]:1234"), "RuntimeError")])
def test_each_kind_of_error_is_settled_as_its_kind_says(error, raised):
    """Out of memory: the section again after its state is restored, and after MAX_ATTEMPTS the rank gives up (a
    job fault: no task fails); the task's own error: TaskFault at once, restored; a storage error and a lost peer:
    the job's, raised as they are (nothing restored: the rank ends)."""
    from marlaas_hpc.runtime.faults import is_job_fault
    from marlaas_hpc.runtime.group_guard import GroupGuard

    trainer = _OneRankTrainer()
    guard, calls = GroupGuard(trainer), []

    def section():
        calls.append(1)
        trainer.state += 1  # what a step changes before it fails
        raise error()

    with pytest.raises(Exception) as caught:
        guard.run("train", section, ["a"])
    assert type(caught.value).__name__ == raised
    assert is_job_fault(caught.value) == (raised != "TaskFault")
    attempts = GroupGuard.MAX_ATTEMPTS if raised == "GroupGaveUp" else 1
    assert len(calls) == attempts and len(guard.regroups) == attempts
    assert trainer.state == (0 if raised in ("GroupGaveUp", "TaskFault") else 1), "restored unless the rank ends"


def test_a_section_that_runs_out_of_memory_once_is_redone_from_its_snapshot():
    from marlaas_hpc.runtime.group_guard import GroupGuard

    trainer = _OneRankTrainer()
    guard, calls = GroupGuard(trainer), []

    def section():
        calls.append(1)
        trainer.state += 1
        if len(calls) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return trainer.state

    assert guard.run("train", section, ["a"]) == 1 and trainer.restored == 1
    assert [(r["attempt"], r["kinds"], r["outcome"]) for r in guard.regroups] == [(1, {"0": "rank"}, "again")]
