"""Issue 25 under Slurm: with `layout.mpi: ulfm` (launch/ulfm_slurm.py) a SIGKILLed rollout rank of a running
het job on the local cluster stops no task: the job finishes by itself (every component COMPLETED, no requeue),
one line names the rank and what was issued again, and every version of every task is trained exactly once.
USR2 to every process of the job's steps (what `--signal=USR2@lead` does) checkpoints it: the daemons' shells
survive it, the job requeues itself and resumes."""
from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import time

import pytest

from marlaas_hpc.launch.mpi import ulfm_prefix
from support.jobs import KILL_STEPS, scale
from support.slurm import cluster, preempt_at_step, sacct_states, slurm_small_config, submit, wait_final  # noqa: F401

pytestmark = [pytest.mark.slurm, pytest.mark.slow,
              pytest.mark.skipif(ulfm_prefix() is None, reason="needs the ULFM Open MPI (tools/setup_env.sh)")]


def test_a_killed_rollout_rank_stops_no_task_under_ulfm(cluster, tmp_path):  # noqa: F811
    steps = KILL_STEPS
    config = slurm_small_config(steps)
    config["layout"].update(mpi="ulfm", rollout_ranks=2)
    job_id, run_dir, _ = submit(config, tmp_path)
    assert preempt_at_step(job_id, run_dir, 3) is None, "the job ended before its third step"
    victim = json.loads((run_dir / "ranks" / "rank2.json").read_text())
    assert victim["role"] == "rollout"
    os.kill(victim["pid"], signal.SIGSTOP)  # held for a moment first: it then holds groups when it dies
    time.sleep(1.0)
    os.kill(victim["pid"], signal.SIGKILL)
    states = wait_final(job_id, run_dir, 600)

    assert states == ["COMPLETED"] * 4, states
    _no_crash(run_dir, job_id)
    assert not (run_dir / "slurm" / "crash_requeues").exists()
    faults = [line for line in (run_dir / "slurm" / f"{job_id}_0_log.out").read_text().splitlines()
              if line.startswith("[fault]")]
    assert len(faults) == 1 and faults[0].startswith("[fault] rank 2 (rollout) lost: died"), faults
    summary = _check_audit(config, run_dir, steps)
    (loss,) = summary["ranks_lost"]
    assert loss["rank"] == 2 and loss["role"] == "rollout" and loss["cause"].startswith("died")
    audit = [json.loads(line) for line in (run_dir / "audit.jsonl").read_text().splitlines()]
    assert not any(r["group_id"] in loss["groups_reissued"] for r in audit), "a lost group is never trained"


def test_usr2_to_every_process_of_a_ulfm_job_checkpoints_requeues_and_resumes(cluster, tmp_path):  # noqa: F811
    """`scancel --signal=USR2` signals every process of every step, as Slurm's `--signal=USR2@lead` does: under ULFM
    the steps are the PRRTE daemons' sruns, whose shells died of it and took every rank of their node along. Now
    they ignore it: rank 0 checkpoints every task, the job requeues itself, the rerun resumes, and every version of
    every task is trained exactly once."""
    steps = 14
    config = slurm_small_config(steps)
    config["layout"].update(mpi="ulfm")
    job_id, run_dir, _ = submit(config, tmp_path)
    assert preempt_at_step(job_id, run_dir, 3) is None, "the job ended before its third step"
    subprocess.run(["scancel", "--signal=USR2", job_id], check=True)
    states = wait_final(job_id, run_dir, 600)

    assert states == ["COMPLETED"] * 4, states
    from marlaas_hpc.runtime.records import read_records

    records = read_records(run_dir)
    assert [run["ended"] for run in records["runs"]] == ["preempted", "finished"]
    assert not records["ranks_lost"] and not (run_dir / "crash.json").exists(), "no rank died of the USR2"
    _check_audit(config, run_dir, steps)


def _no_crash(run_dir, job_id: str) -> None:
    """No rank's loss stopped the job (the step guard keeps its message in crash.json); else the message and the
    end of the launcher's log, which says what PRRTE saw."""
    crash = run_dir / "crash.json"
    if crash.exists():
        err = run_dir / "slurm" / f"{job_id}_0_log.err"
        pytest.fail(f"{crash.read_text()}\n{err.read_text()[-3000:] if err.exists() else ''}")


def _rank0_log(run_dir, job_id: str) -> list[str]:
    path = run_dir / "slurm" / f"{job_id}_0_log.out"
    return path.read_text().splitlines() if path.exists() else []


def _wait_line(run_dir, job_id: str, prefix: str, timeout_s: float = 120) -> str:
    """The first line of rank 0's log that starts with `prefix` (fails once the job has ended without it)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = [line for line in _rank0_log(run_dir, job_id) if line.startswith(prefix)]
        if found:
            return found[0]
        states = sacct_states(job_id)
        if len(states) == 4 and all(s.split()[0] in ("FAILED", "CANCELLED", "COMPLETED", "TIMEOUT") for s in states):
            break
        time.sleep(0.5)
    pytest.fail(f"no line {prefix!r} in rank 0's log ({sacct_states(job_id)}):\n"
                + "\n".join(_rank0_log(run_dir, job_id)[-30:]))


def _check_audit(config: dict, run_dir, steps: int) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    audit = [json.loads(line) for line in (run_dir / "audit.jsonl").read_text().splitlines()]
    for task in config["tasks"]:
        task_id, algo = task["task_id"], task["algo"]
        assert summary["tasks"][task_id]["status"] == "done", summary["tasks"][task_id]
        rows = [r for r in audit if r["task_id"] == task_id]
        per_version = collections.Counter(r["trained_into"] for r in rows)
        assert per_version == {v: algo["batch_prompts"] * algo["group_size"] for v in range(1, steps + 1)}
        assert len({(r["group_id"], r["sample"]) for r in rows}) == len(rows), "no sample trained twice"
    return summary


def _join_config(steps: int) -> dict:
    """The small job for the replacement test, whose new rank must get training groups: `add` at k=1, so that
    either task alone has (k+1) x B = 8 groups outstanding, more than one rank's 4 slots (rank 0 fills ranks in
    order, so a joiner gets groups only when the first rank is full). With k=0 a CI run saw `sort` end before the
    replacement was up, and `add`'s 4 groups all went to the surviving rank. (The scale test keeps k=0: with k=1 its
    job's end hung once here, its components CANCELLED at the test's timeout; not looked into.)"""
    config = slurm_small_config(steps)
    next(task for task in config["tasks"] if task["task_id"] == "add")["max_staleness"] = 1
    return config


def _joined_groups(run_dir, rank: int) -> list[dict]:
    path = run_dir / "timeline" / f"rank{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if '"stage": "group"' in line]


def test_rollout_replace_starts_the_new_rank_on_the_dead_ranks_node_under_ulfm(cluster, tmp_path):  # noqa: F811
    """`layout.rollout_replace` under Slurm: the replacement of a SIGKILLed rollout rank is spawned onto the dead
    rank's node, in its slot (its SLURM_* variables, so launch/devices.py gives it that rank's GPU), generates groups
    that are trained, and the job finishes by itself with every version trained exactly once."""
    steps = 40
    config = _join_config(steps)
    config["layout"].update(mpi="ulfm", rollout_ranks=2, rollout_replace=True)
    job_id, run_dir, _ = submit(config, tmp_path)
    assert preempt_at_step(job_id, run_dir, 3) is None, "the job ended before its third step"
    victim = json.loads((run_dir / "ranks" / "rank2.json").read_text())
    assert victim["role"] == "rollout"
    os.kill(victim["pid"], signal.SIGKILL)
    joined = 6  # the next world rank after control, env, 2 rollout and 2 trainer ranks
    started = _wait_line(run_dir, job_id, f"[scale] starting rollout rank {joined} to replace rank 2")
    assert f"on {victim['host']}" in started, started
    _wait_line(run_dir, job_id, f"[scale] rollout rank {joined} joined")
    states = wait_final(job_id, run_dir, 300)

    assert states == ["COMPLETED"] * 4, states
    _no_crash(run_dir, job_id)
    new = json.loads((run_dir / "ranks" / f"rank{joined}.json").read_text())
    assert new["role"] == "rollout (joined)" and new["host"] == victim["host"], (new, victim)
    assert new["slot"] == 2, "it runs as the dead rank's task of the rollout component (its SLURM_* variables)"
    summary = _check_audit(config, run_dir, steps)
    assert [r["rank"] for r in summary["ranks_lost"]] == [2] and [r["rank"] for r in summary["ranks_joined"]] == [joined]
    trained = {r["group_id"] for r in map(json.loads, (run_dir / "audit.jsonl").read_text().splitlines())}
    assert {g["group_id"] for g in _joined_groups(run_dir, joined) if not g["eval"]} & trained, \
        "groups the replacement generated were trained"


def test_marlaas_scale_under_ulfm_drains_refills_the_free_slot_and_refuses_beyond_the_allocation(cluster, tmp_path):  # noqa: F811
    """`marlaas scale` in a Slurm job (layout.mpi: ulfm), rollout component of 2 slots: 2 -> 1 drains rank 3 (it
    leaves, nothing lost); 1 -> 3 is refused with one line (one free slot); 1 -> 2 starts a rank in rank 3's slot,
    on its node, which generates groups that are trained; 2 -> 1 is then refused with one line (under Slurm no rank
    leaves once one joined). Every version trained exactly once, every component COMPLETED."""
    steps = 60
    config = slurm_small_config(steps)
    config["layout"].update(mpi="ulfm", rollout_ranks=2)
    job_id, run_dir, _ = submit(config, tmp_path)
    assert preempt_at_step(job_id, run_dir, 3) is None, "the job ended before its third step"
    slot = json.loads((run_dir / "ranks" / "rank3.json").read_text())
    scale(run_dir, 1)
    _wait_line(run_dir, job_id, "[scale] rollout rank 3 drained and left")
    scale(run_dir, 3)
    refused = _wait_line(run_dir, job_id, "[scale] rollout ranks 3 asked for, not done")
    assert "1 free slot(s) of 2" in refused, refused
    scale(run_dir, 2)
    started = _wait_line(run_dir, job_id, "[scale] starting rollout rank 6")
    assert started.endswith(f"on {slot['host']} in rank 3's slot"), started
    _wait_line(run_dir, job_id, "[scale] rollout rank 6 joined")
    time.sleep(3.0)
    scale(run_dir, 1)
    refused = _wait_line(run_dir, job_id, "[scale] rollout ranks 1 asked for, not done")
    assert "no rank drains once one joined" in refused, refused
    states = wait_final(job_id, run_dir, 400)

    assert states == ["COMPLETED"] * 4, states
    new = json.loads((run_dir / "ranks" / "rank6.json").read_text())
    assert new["host"] == slot["host"] and new["slot"] == 3
    summary = _check_audit(config, run_dir, steps)
    assert [r["rank"] for r in summary["ranks_left"]] == [3] and not summary["ranks_lost"]
    trained = {r["group_id"] for r in map(json.loads, (run_dir / "audit.jsonl").read_text().splitlines())}
    assert {g["group_id"] for g in _joined_groups(run_dir, 6) if not g["eval"]} & trained, "the joined rank's groups"
