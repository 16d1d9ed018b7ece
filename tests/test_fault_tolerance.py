"""A lost worker rank stops no tenant (issue 25), with real `marlaas run` jobs on the fault-tolerant MPI (ULFM)
local mode runs on: SIGKILL of one of two rollout ranks, or of one of two env ranks, in a running job. The job
finishes every task by itself (exit 0, no --resume), one line names the rank, its role, the cause and what was
issued again, summary.json records the loss, and every version of every task is trained exactly once, from B
groups, none twice (audit.jsonl)."""
from __future__ import annotations

import json
import os
import random
import signal
import time
from pathlib import Path

import pytest
import yaml

from marlaas_hpc.launch.mpi import ulfm_prefix
from marlaas_hpc.launch.monitor import RankReporter
from support.checks import check_ended_with_its_summary, check_every_version_once
from support.configs import small_config
from support.jobs import FAULT_STEPS as STEPS
from support.jobs import KILL_STEPS
from support.jobs import SEED, Job, marlaas_stdout, rank_record, scale

pytestmark = [pytest.mark.mpi, pytest.mark.slow,
              pytest.mark.skipif(ulfm_prefix() is None, reason="needs the ULFM Open MPI (tools/setup_env.sh)")]


def _config(tmp_path: Path, fault: dict | None = None, steps: int = STEPS, **layout) -> Path:
    config = small_config(layout={"env_ranks": 1, "rollout_ranks": 1, "trainer_tp": 1, **layout},
                          checkpoint={"every_steps": 5, "every_minutes": 0}, fault=fault or {})
    for task in config["tasks"]:
        task["total_steps"] = steps
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _kill_one(tmp_path: Path, role: str, **layout) -> tuple[Job, dict, Path]:
    run_dir, rng = tmp_path / "run", random.Random(SEED)
    job = Job([str(_config(tmp_path, steps=KILL_STEPS, **layout)), "--run-dir", str(run_dir)], tmp_path)
    job.wait_steps(3 + rng.randint(0, 3))
    time.sleep(rng.uniform(0.0, 0.5))
    victims = sorted((json.loads(p.read_text()) for p in (run_dir / "ranks").glob("rank*.json")),
                     key=lambda r: r["rank"])
    victim = [r for r in victims if r["role"] == role][0]  # the first: the scheduler fills it first
    # held still for a moment first, so that it holds groups when it dies: the tiny model's groups are generated and
    # scored in milliseconds, and at a random instant a rank often held none (then nothing is issued again)
    os.kill(victim["pid"], signal.SIGSTOP)
    time.sleep(1.0)
    os.kill(victim["pid"], signal.SIGKILL)
    code = job.finish()
    assert code == 0, f"seed {SEED}: the job did not finish by itself:\n{job.output()}"
    check_ended_with_its_summary(run_dir, time.time())  # the rollout kill's did not, in ~1 run of 2, before
    return job, victim, run_dir


@pytest.mark.parametrize("role, layout", [("rollout", {"rollout_ranks": 2}), ("env", {"env_ranks": 2})])
def test_sigkill_of_one_worker_rank_stops_no_task(tmp_path, role, layout):
    job, victim, run_dir = _kill_one(tmp_path, role, **layout)
    lines = [line for line in job.lines if line.startswith("[fault]")]
    assert len(lines) == 1, job.output()
    assert lines[0].startswith(f"[fault] rank {victim['rank']} ({role}) lost: died") and "issued again" in lines[0]
    assert "job stopped" not in job.err and not (run_dir / "crash.json").exists()
    summary = check_every_version_once(run_dir, KILL_STEPS)
    (loss,) = summary["ranks_lost"]
    assert loss["rank"] == victim["rank"] and loss["role"] == role and loss["cause"].startswith("died")
    reissued = sum(t["reissued_groups"] for t in summary["tasks"].values())
    assert reissued == len(loss["groups_reissued"]) > 0, "the victim held groups (workers are kept busy)"
    audit = (run_dir / "audit.jsonl").read_text()
    assert not any(f'"group_id": "{gid}"' in audit for gid in loss["groups_reissued"]), \
        "a lost group is never trained (its prompt is, under a fresh id)"
    assert set(summary["busy_fraction"]) == {"env", "rollout", "trainer", "scheduler"}


def test_losing_the_last_rollout_rank_stops_the_job_resumably_and_says_why(tmp_path):
    """With one rollout rank nothing can take its work: the job stops with the one message, which names the lost
    rank and why the job could not go on, and the run dir resumes as after any crash."""
    from marlaas_hpc.runtime.checkpoint import load_job_checkpoint

    run_dir = tmp_path / "run"
    job = Job([str(_config(tmp_path, steps=KILL_STEPS)), "--run-dir", str(run_dir)], tmp_path)
    job.wait_steps(3)
    victim = rank_record(run_dir, "rollout")
    os.kill(victim["pid"], signal.SIGKILL)
    assert job.finish() not in (0, 75)
    stops = [line for line in job.err.splitlines() if line.startswith("marlaas: job stopped")]
    assert len(stops) == 1, job.output()
    assert f"rank {victim['rank']} (rollout" in stops[0] and "no task is at fault" in stops[0]
    assert "The job could not go on without it: no rollout rank is left" in stops[0]
    assert f"marlaas run --resume {run_dir}" in stops[0]
    assert load_job_checkpoint(run_dir) is not None, "the run dir is resumable"


def test_sigkill_of_rank_0_stops_the_job_with_one_message_and_it_resumes(tmp_path):
    """Rank 0 (the scheduler) is a single point: its death stops the job with the one message and a failed status
    (the ULFM mpiexec itself exits 0 after it), and `marlaas run --resume` finishes every task, each version
    trained exactly once over both runs."""
    run_dir = tmp_path / "run"
    job = Job([str(_config(tmp_path, steps=KILL_STEPS, rollout_ranks=2)), "--run-dir", str(run_dir)], tmp_path)
    job.wait_steps(8)
    os.kill(rank_record(run_dir, "scheduler")["pid"], signal.SIGKILL)
    code = job.finish()
    stops = [line for line in job.err.splitlines() if line.startswith("marlaas: job stopped")]
    assert code not in (0, 75) and len(stops) == 1, job.output()
    assert stops[0].startswith("marlaas: job stopped: rank 0 (scheduler") and "does not go on without it" in stops[0]
    assert f"marlaas run --resume {run_dir}" in stops[0] and (run_dir / "crash.json").exists()
    resumed = Job(["--resume", str(run_dir)], tmp_path)
    assert resumed.finish() == 0, resumed.output()
    check_every_version_once(run_dir, KILL_STEPS)


def test_a_rollout_rank_stopped_with_sigstop_is_found_hung_killed_and_handled_as_lost(tmp_path):
    """SIGSTOP: the rank is alive but makes no progress (its heartbeat stops). After fault.hang_timeout_s its
    supervisor names it, kills it, and the job goes on without it as after a SIGKILL."""
    run_dir = tmp_path / "run"
    job = Job([str(_config(tmp_path, fault={"hang_timeout_s": 4}, rollout_ranks=2)), "--run-dir", str(run_dir)],
              tmp_path)
    job.wait_steps(3)
    victim = [r for r in (json.loads(p.read_text()) for p in sorted((run_dir / "ranks").glob("rank*.json")))
              if r["role"] == "rollout"][-1]
    os.kill(victim["pid"], signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        assert job.finish() == 0, job.output()
    finally:
        try:
            os.kill(victim["pid"], signal.SIGKILL)  # never left stopped, whatever happened
        except ProcessLookupError:
            pass
    lines = [line for line in job.lines if line.startswith("[fault]")]
    assert len(lines) == 1 and lines[0].startswith(f"[fault] rank {victim['rank']} (rollout) lost: hung:"), \
        job.output()
    assert "no heartbeat for" in lines[0] and "killed with SIGKILL" in lines[0]
    summary = check_every_version_once(run_dir, STEPS)
    (loss,) = summary["ranks_lost"]
    assert loss["rank"] == victim["rank"] and loss["cause"].startswith("hung")
    # silence counts from its last beat, which came up to one beat period before the stop
    assert loss["at"] - (time.time() - (time.monotonic() - stopped)) >= 4 - RankReporter.BEAT_S, "not too early"


def test_sigkill_of_one_rank_of_one_of_two_trainer_groups_rolls_back_that_groups_tasks_only(tmp_path):
    """Two trainer groups of TP=2; SIGKILL of group 1's TP rank 1. Group 1 is dissolved (its leader ends too),
    its tasks go back to their newest checkpoint and finish on group 0; the other tasks never go back; every
    version is still trained exactly once (the audit and metrics.jsonl lose the rolled-back steps)."""
    run_dir = tmp_path / "run"
    config = small_config(layout={"env_ranks": 1, "rollout_ranks": 1, "trainer_tp": 2, "trainer_groups": 2},
                          checkpoint={"every_steps": 5, "every_minutes": 0})
    config["tasks"].append({**config["tasks"][0], "task_id": "add2", "tenant": "carol"})
    for task in config["tasks"]:
        task["total_steps"] = KILL_STEPS
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(config))
    job = Job([str(path), "--run-dir", str(run_dir)], tmp_path)
    job.wait_steps(6)
    victim = rank_record(run_dir, "trainer follower of trainer group 1, TP rank 1")
    os.kill(victim["pid"], signal.SIGKILL)
    assert job.finish() == 0, f"seed {SEED}: the job did not finish by itself:\n{job.output()}"
    lines = [line for line in job.lines if line.startswith("[fault]")]
    assert len(lines) == 1 and "(trainer (group 1)) lost" in lines[0] and "back to their checkpoint" in lines[0], \
        job.output()
    summary = check_every_version_once(run_dir, KILL_STEPS)
    (loss,) = summary["ranks_lost"]
    rolled = loss["tasks_rolled_back"]
    assert rolled, "group 1 owned a task"
    for task_id, (reached, back) in rolled.items():
        assert back <= reached and back % 5 == 0, "back to a checkpoint (every 5 steps)"
    for task_id, info in summary["tasks"].items():
        assert info["trainer_group"] == 0 or task_id not in rolled
        metrics = [json.loads(line)["version"] for line in
                   (run_dir / "tasks" / info["tenant"] / task_id / "metrics.jsonl").read_text().splitlines()]
        assert metrics == list(range(1, KILL_STEPS + 1)), f"{task_id}: each version once in metrics.jsonl"
    audit = [json.loads(line) for line in (run_dir / "audit.jsonl").read_text().splitlines()]
    others = [r for r in audit if r["task_id"] not in rolled]
    assert others and all(".r" not in r["group_id"] for r in others), "no other task went back"


def test_marlaas_scale_adds_a_rollout_rank_to_a_live_job_then_drains_it(tmp_path):
    """1 -> 2 rollout ranks: a new process joins (MPI_Comm_spawn; links by connect/accept; the delta channels
    remade with it), generates groups, and writes its ranks/ and timeline/ files like any rank. 2 -> 1: it
    drains and leaves. The job finishes by itself with every version trained exactly once."""
    run_dir = tmp_path / "run"
    job = Job([str(_config(tmp_path)), "--run-dir", str(run_dir)], tmp_path)
    job.wait_steps(3)
    scale(run_dir, 2)
    job.wait_lines("[scale] rollout rank 4 joined")
    job.wait_steps(job.steps() + 6)
    assert "ranks: rollout [2, 4] (joined [4])" in marlaas_stdout("status", run_dir), "marlaas status shows it"
    scale(run_dir, 1)
    job.wait_lines("[scale] rollout rank 4 drained and left")
    assert job.finish() == 0, job.output()
    joined = json.loads((run_dir / "ranks" / "rank4.json").read_text())
    assert joined["role"] == "rollout (joined)"
    groups = [json.loads(line) for line in (run_dir / "timeline" / "rank4.jsonl").read_text().splitlines()
              if '"stage": "group"' in line]
    assert groups, "the joined rank generated groups"
    summary = check_every_version_once(run_dir, STEPS)
    assert [r["rank"] for r in summary["ranks_joined"]] == [4] and [r["rank"] for r in summary["ranks_left"]] == [4]
    assert "4" in summary["engine_restarts"], "its RankStats reached rank 0 before it left"
    trained = {r["group_id"] for r in map(json.loads, (run_dir / "audit.jsonl").read_text().splitlines())}
    assert {g["group_id"] for g in groups if not g["eval"]} & trained, "groups it generated were trained"


def test_rollout_replace_starts_a_new_rank_for_a_killed_one(tmp_path):
    run_dir = tmp_path / "run"
    config = small_config(layout={"env_ranks": 1, "rollout_ranks": 1, "trainer_tp": 1, "rollout_replace": True},
                          checkpoint={"every_steps": 5, "every_minutes": 0})
    for task in config["tasks"]:
        task["total_steps"] = STEPS
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(config))
    job = Job([str(path), "--run-dir", str(run_dir)], tmp_path)
    job.wait_steps(3)
    victim = rank_record(run_dir, "rollout")
    os.kill(victim["pid"], signal.SIGKILL)
    job.wait_lines("[scale] rollout rank 4 joined")
    assert job.finish() == 0, job.output()
    assert any(line.startswith("[scale] starting rollout rank 4 to replace rank 2") for line in job.lines)
    summary = check_every_version_once(run_dir, STEPS)
    assert summary["ranks_lost"][0]["rank"] == victim["rank"] and summary["ranks_joined"][0]["rank"] == 4


def test_two_joiners_take_the_base_weights_from_a_live_rollout_rank_in_a_chain(tmp_path):
    """1 -> 3 rollout ranks with `layout.join_weights: peer`: rank 0 sends no byte of the model; the live rollout
    rank 2 feeds joiner 4, which forwards each chunk to joiner 5 as it comes (runtime/peer_weights.py). Each joiner
    holds byte-identical copies of the model's files in node-local tmp, starts its engine from them, generates
    groups that are trained, and the copies are removed when it ends."""
    from marlaas_hpc.runtime.peer_weights import local_weights_dir, manifest
    from marlaas_hpc.tiny_model import ensure_tiny_model

    run_dir = tmp_path / "run"
    job = Job([str(_config(tmp_path, join_weights="peer")), "--run-dir", str(run_dir)], tmp_path)
    job.wait_steps(3)
    scale(run_dir, 3)
    job.wait_lines("[scale] base weights: rollout rank 2 -> 4 -> 5", "[join] rank 4: base weights from rank 2",
                   "[join] rank 5: base weights from rank 4", "[scale] rollout rank 4 joined",
                   "[scale] rollout rank 5 joined")
    model = ensure_tiny_model()
    for rank in (4, 5):
        local = local_weights_dir(run_dir, rank)
        assert manifest(local) == manifest(model)
        for name, _ in manifest(model):
            assert (local / name).read_bytes() == (model / name).read_bytes(), (rank, name)
    job.wait_steps(job.steps() + 6)
    assert job.finish() == 0, job.output()
    check_every_version_once(run_dir, STEPS)
    trained = {r["group_id"] for r in map(json.loads, (run_dir / "audit.jsonl").read_text().splitlines())}
    for rank in (4, 5):
        timeline = [json.loads(line) for line in (run_dir / "timeline" / f"rank{rank}.jsonl").read_text().splitlines()]
        assert any(s["stage"] == "base_weights" for s in timeline)
        groups = {s["group_id"] for s in timeline if s["stage"] == "group" and not s["eval"]}
        assert groups & trained, f"groups rank {rank} generated were trained"
        assert not local_weights_dir(run_dir, rank).exists(), "its copy is removed when it ends"
