"""`marlaas submit` against the real local Slurm (slurm/local-cluster/start.sh): the multi-task job runs as a
4-component heterogeneous job to COMPLETED; USR2 checkpoints it, it requeues itself and resumes, and every
task ends with each version 1..total_steps trained exactly once."""
from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from support.jobs import marlaas
from support.slurm import cluster, mpi_init_crashed, preempt_at_step, retry_note, sacct_states  # noqa: F401 (cluster: a fixture)
from support.slurm import slurm_small_config, submit, wait_final

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
def _crashed_in_mpi_init(job_id: str, run_dir: Path, states: list[str]) -> bool:
    """The known Open MPI segfault of the emulated cluster (see test_slurm_cluster.py): retry such a job once."""
    if states == ["COMPLETED"] * 4 or not mpi_init_crashed(list((run_dir / "slurm").glob("*_log.err"))):
        return False
    retry_note(job_id)
    return True


def _first_step_time(run_dir: Path) -> float:
    times = []
    for metrics in run_dir.glob("tasks/*/*/metrics.jsonl"):
        times.append(json.loads(metrics.read_text().splitlines()[0])["time"])
    return min(times)


def test_submit_runs_the_multi_task_job_as_a_het_job(cluster, tmp_path):
    for attempt in range(2):
        job_id, run_dir, t0 = submit(slurm_small_config(4), tmp_path / f"attempt{attempt}")
        states = wait_final(job_id, run_dir, 400)
        if not (attempt == 0 and _crashed_in_mpi_init(job_id, run_dir, states)):
            break
    assert states == ["COMPLETED"] * 4
    summary = json.loads((run_dir / "summary.json").read_text())
    assert {t: (s["status"], s["steps_done"]) for t, s in summary["tasks"].items()} == \
        {"add": ("done", 4), "sort": ("done", 4)}
    for tenant, task_id in (("alice", "add"), ("bob", "sort")):
        adapters = sorted(p.name for p in (run_dir / "tasks" / tenant / task_id / "adapters").iterdir())
        assert adapters == ["v0000", "v0003", "v0004"]  # the default retention (adapters:)
    status = marlaas("status", job_id, timeout=300)
    assert status.returncode == 0 and f"Slurm job {job_id}: COMPLETED" in status.stdout
    assert "finished" in status.stdout
    print(f"\nsubmit -> first optimizer step: {_first_step_time(run_dir) - t0:.1f} s "
          f"(ranks ready after {summary['startup_s']:.1f} s of it)")


def test_usr2_requeues_and_resumes_without_lost_or_repeated_steps(cluster, tmp_path):
    steps = 14
    config = slurm_small_config(steps)
    for attempt in range(2):
        job_id, run_dir, _ = submit(config, tmp_path / f"attempt{attempt}")
        states = preempt_at_step(job_id, run_dir, 3)
        if states is None:
            t0, t0_wall = time.monotonic(), time.time()
            subprocess.run(["scancel", "--signal=USR2", job_id], check=True)
            states = wait_final(job_id, run_dir, 500)
        if not (attempt == 0 and _crashed_in_mpi_init(job_id, run_dir, states)):
            break
    assert states == ["COMPLETED"] * 4
    round_trip = time.monotonic() - t0
    from marlaas_hpc.runtime.checkpoint import read_records

    checkpoint = read_records(run_dir)
    assert [run["ended"] for run in checkpoint["runs"]] == ["preempted", "finished"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["preempted"] is False and len(summary["previous_runs"]) == 1
    audit = [json.loads(line) for line in (run_dir / "audit.jsonl").read_text().splitlines()]
    for task in config["tasks"]:
        task_id, algo = task["task_id"], task["algo"]
        assert summary["tasks"][task_id]["steps_done"] == steps  # final version == configured total steps
        metrics = (run_dir / "tasks" / task["tenant"] / task_id / "metrics.jsonl").read_text().splitlines()
        assert [json.loads(m)["version"] for m in metrics] == list(range(1, steps + 1))  # none twice, none lost
        per_version = collections.Counter(r["trained_into"] for r in audit if r["task_id"] == task_id)
        assert per_version == {v: algo["batch_prompts"] * algo["group_size"] for v in range(1, steps + 1)}
    preempted = checkpoint["runs"][0]["started"] + checkpoint["runs"][0]["wall_time_s"]
    saved = {task["task_id"]: max(json.loads(m)["version"] for m in (run_dir / "tasks" / task["tenant"] /
             task["task_id"] / "metrics.jsonl").read_text().splitlines() if json.loads(m)["time"] <= preempted)
             for task in config["tasks"]}
    resumed_step = min(json.loads(m)["time"] for task in config["tasks"] for m in
                       (run_dir / "tasks" / task["tenant"] / task["task_id"] / "metrics.jsonl").read_text().splitlines()
                       if json.loads(m)["version"] == saved[task["task_id"]] + 1)
    print(f"\ncheckpointed at {saved}; USR2 -> first step of the requeued run {resumed_step - t0_wall:.1f} s "
          f"(checkpoint drain {preempted - t0_wall:.1f} s); USR2 -> COMPLETED {round_trip:.1f} s")


def test_a_killed_rank_requeues_the_job_which_resumes_from_the_periodic_checkpoints(cluster, tmp_path):
    """SIGKILL of the rollout rank: srun ends the step, the step guard names the rank and requeues the job, the
    rerun resumes every task from its last periodic checkpoint and finishes; every version trained once."""
    steps, every = 14, 2
    config = slurm_small_config(steps)
    config["checkpoint"] = {"every_steps": every, "every_minutes": 0, "max_crash_requeues": 1}
    for attempt in range(2):
        job_id, run_dir, _ = submit(config, tmp_path / f"attempt{attempt}")
        states = preempt_at_step(job_id, run_dir, 3)
        if states is None:
            rollout = json.loads((run_dir / "ranks" / "rank2.json").read_text())
            assert rollout["role"] == "rollout"
            reached_before_kill = time.time()
            os.kill(rollout["pid"], signal.SIGKILL)
            states = wait_final(job_id, run_dir, 600)
        if not (attempt == 0 and _crashed_in_mpi_init(job_id, run_dir, states)):
            break
    assert states == ["COMPLETED"] * 4
    crash = json.loads((run_dir / "crash.json").read_text())
    assert crash["rank"] == 2 and crash["role"] == "rollout" and crash["requeued"] is True
    assert crash["time"] - reached_before_kill < 30, "the step ended within seconds of the kill"
    # who ends srun first is a race: srun itself (--kill-on-bad-exit, exit 128 + 9, read as the signal) or the
    # guard's supervisor (then the signal is unknown and srun's own "task N: Killed" line is passed on)
    message = crash["message"]
    assert ("died: killed by signal 9 (SIGKILL)" in message
            or ("without an error report" in message and ": Killed" in message)), message
    assert "Requeueing job" in crash["message"] and (run_dir / "slurm" / "crash_requeues").read_text() == "1\n"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert [r["ended"] for r in summary["previous_runs"]] == ["crashed"]
    audit = [json.loads(line) for line in (run_dir / "audit.jsonl").read_text().splitlines()]
    for task in config["tasks"]:
        task_id, algo = task["task_id"], task["algo"]
        assert summary["tasks"][task_id]["status"] == "done" and summary["tasks"][task_id]["steps_done"] == steps
        metrics = (run_dir / "tasks" / task["tenant"] / task_id / "metrics.jsonl").read_text().splitlines()
        assert [json.loads(m)["version"] for m in metrics] == list(range(1, steps + 1))
        per_version = collections.Counter(r["trained_into"] for r in audit if r["task_id"] == task_id)
        assert per_version == {v: algo["batch_prompts"] * algo["group_size"] for v in range(1, steps + 1)}


def test_bad_configs_are_refused_before_submission(cluster, tmp_path):
    cases = {
        "trainer.partition": ({"trainer": {"partition": "a100", "gpus_per_task": 1}}, "unknown partition 'a100'"),
        "env.ntasks": ({"env": {"partition": "cpu", "ntasks": 0}}, "at least one task"),
        "trainer.ntasks": ({"trainer": {"partition": "gpu", "ntasks": 3}}, "not a multiple of trainer_tp"),
        "env.gpus_per_task": ({"env": {"partition": "cpu", "gpus_per_task": 1}}, "CPU-only"),
    }
    for field, (layout, message) in cases.items():
        config = slurm_small_config(4)
        config["layout"].update(layout)
        path = tmp_path / f"{field}.yaml"
        path.write_text(yaml.safe_dump(config))
        before = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True).stdout
        proc = marlaas("submit", str(path), "--run-dir", str(tmp_path / field), timeout=300)
        assert proc.returncode == 2 and field in proc.stderr and message in proc.stderr, (field, proc.stderr)
        after = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True).stdout
        assert before == after, "nothing was submitted"


def test_cancel_stops_every_component(cluster, tmp_path):
    job_id, run_dir, _ = submit(slurm_small_config(50), tmp_path)
    proc = marlaas("cancel", job_id, timeout=300)
    assert proc.returncode == 0 and f"cancelled job {job_id}" in proc.stdout and str(run_dir) in proc.stdout
    deadline = time.monotonic() + 120
    while not (len(states := sacct_states(job_id)) == 4 and all(s.startswith("CANCELLED") for s in states)):
        assert time.monotonic() < deadline, f"job {job_id} not cancelled: {states}"
        time.sleep(1)
    assert f"Slurm job {job_id}: CANCELLED" in marlaas("status", job_id, timeout=300).stdout
