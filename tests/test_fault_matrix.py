"""Fault matrix (issue 16) with real `marlaas run` jobs: one run dir, one fault per run, each run resumed by the
next with `marlaas run --resume`. Per cell: the one message naming the rank, its role and the cause; a resumable
run dir; no task loses more than one checkpoint interval (`checkpoint.every_steps`); and at the end every
version of every task is trained exactly once over all runs (audit.jsonl, metrics.jsonl).

    run 1  tasks add, sort (training), broken (its reward function raises), lookup (its tool hangs past
           env_pool.step_timeout_s): broken and lookup fail alone; then SIGKILL of the env rank
    run 2  SIGKILL of the rollout rank          run 3  SIGKILL of the trainer follower (TP rank 1)
    run 4  resumed after a shard of add's newest checkpoint was damaged (add falls back to its previous
           checkpoint); then SIGKILL of the trainer leader
    run 5  SIGKILL of rank 0 (scheduler)        run 6  add's adapter directory (a small tmpfs) fills up:
                                                       the trainer leader's adapter write fails (root only)
    run 7  runs to the end

Kills come at a random point: once each training task has made EVERY to EVERY + 2 steps in this run (so that the
chain moves on: a run killed before any new checkpoint resumes where it started) and after a random delay
(seed: MARLAAS_FAULT_SEED, printed on failure). Cells share the run dir because each fault leaves what the next run resumes from; every job start
costs ~20-60 s on 2 cores, so one chain of 7 runs keeps the matrix to a few minutes.
"""
from __future__ import annotations

import collections
import errno
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from support.configs import small_config
from support.jobs import ROOT, SEED, Job, job_env, rank_record

pytestmark = [pytest.mark.mpi, pytest.mark.slow]
STEPS = 100
"""Steps of each task: enough that the job is still running at the last kill. Each of the six cells lets
2-4 steps pass, up to a second of steps more, and loses up to EVERY; at 40 a job whose steps took ~0.15 s had
finished before the scheduler cell could kill it."""
EVERY = 2
"""checkpoint.every_steps: the most steps a task may lose to a crash."""
TENANTS = {"add": "alice", "sort": "bob"}


def _reached(run_dir: Path) -> dict[str, int]:
    """Newest version each training task reached (its metrics.jsonl, before a resume rolls it back)."""
    out = {}
    for task_id, tenant in TENANTS.items():
        path = run_dir / "tasks" / tenant / task_id / "metrics.jsonl"
        versions = [json.loads(line)["version"] for line in path.read_text().splitlines()] if path.exists() else []
        out[task_id] = max(versions, default=0)
    return out


def _saved(run_dir: Path) -> dict[str, dict]:
    from marlaas_hpc.runtime.checkpoint import load_job_checkpoint

    state = load_job_checkpoint(run_dir)
    assert state is not None, "the run dir is resumable"
    return state["tasks"]


def _config(tmp_path: Path) -> Path:
    (tmp_path / "bad_reward.py").write_text(
        "def reward(sample, completion):\n    raise RuntimeError('verifier crashed on purpose')\n")
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(40)))
    # the system's MPI (Debian's Open MPI 4: no ULFM): the stop-and-resume path Slurm runs take, whose message says
    # why a rank's loss stops the job (tests/test_fault_tolerance.py: the job that goes on)
    config = small_config(fault={"local_mpi": "system"}, checkpoint={"every_steps": EVERY, "every_minutes": 0},
                          env_pool={"mode": "thread", "workers": 4, "step_timeout_s": 3},
                          adapters={"keep_every": 1})  # every version stays: the final cell checks each is there
    for task in config["tasks"]:
        task["total_steps"] = STEPS
    config["tasks"] += [
        {"task_id": "broken", "tenant": "eve", "total_steps": 4,
         "dataset": {"kind": "custom", "path": str(data), "reward_fn": f"{tmp_path / 'bad_reward.py'}:reward",
                     "eval_size": 4},
         "algo": {"group_size": 4, "batch_prompts": 4, "max_new_tokens": 4}},
        {"task_id": "lookup", "tenant": "carol", "total_steps": 4,
         "dataset": {"kind": "lookup", "eval_size": 8, "tool_latency_s": 30},
         "algo": {"group_size": 4, "batch_prompts": 4, "max_new_tokens": 6, "max_turns": 3,
                  "max_episode_tokens": 40}}]
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _mount_small_disk(folder: Path) -> str | None:
    """add's adapter directory on a tmpfs of its own (a disk the test can fill); None if it is mounted."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return "needs root to mount a tmpfs"
    folder.mkdir(parents=True)
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(folder)], capture_output=True,
                          text=True)
    return None if proc.returncode == 0 else f"mount -t tmpfs failed: {proc.stderr.strip()}"


def _free_bytes(folder: Path) -> int:
    stat = os.statvfs(folder)
    return stat.f_bavail * stat.f_frsize


def _fill(folder: Path, leave_bytes: int) -> Path:
    """A ballast file that leaves about `leave_bytes` free on folder's filesystem (less than one adapter). The
    job writes adapters meanwhile: a write that finds the disk full already is fine, the ballast then gives
    back what it must to leave `leave_bytes`."""
    ballast = folder / "ballast"
    with open(ballast, "wb", buffering=0) as sink:
        try:
            while (free := _free_bytes(folder)) > leave_bytes:
                sink.write(b"\0" * min(free - leave_bytes, 1 << 20))
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
        short = leave_bytes - _free_bytes(folder)
        if short > 0:
            sink.truncate(max(0, ballast.stat().st_size - short))
    return ballast


def _corrupt_newest_shard(run_dir: Path) -> dict:
    """Flips one byte in the middle of TP rank 1's shard of add's newest checkpoint."""
    entry = _saved(run_dir)["add"]
    version = entry["saved"]["version"]
    assert version is not None, "add has been checkpointed by now"
    shard = run_dir / "tasks" / "alice" / "add" / "checkpoint" / f"tp1-v{version:06d}.pt"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    return {"version": version, "previous": entry["previous"]["version"] if entry["previous"] else None,
            "shard": shard.name}


def _kill_cell(job: Job, run_dir: Path, role: str, rng: random.Random) -> dict:
    """SIGKILL of the rank with `role` at a random point: after EVERY to EVERY + 2 steps of this run and 0-1 s."""
    job.wait_steps(EVERY + rng.randint(0, 2))
    time.sleep(rng.uniform(0.0, 1.0))
    target = rank_record(run_dir, role)
    os.kill(target["pid"], signal.SIGKILL)
    return {"fault": f"SIGKILL {role}", "rank": target["rank"], "role": role, "killed_at": time.time()}


def _outcome(job: Job, run_dir: Path, cell: dict) -> dict:
    code = job.finish()
    cell["stop_s"] = time.time() - cell.pop("killed_at", time.time())
    stops = [line for line in job.err.splitlines() if line.startswith("marlaas: job stopped")]
    tasks = _saved(run_dir)
    reached = _reached(run_dir)
    return {**cell, "code": code, "messages": stops, "stdout": list(job.lines), "output": job.output(),
            "crash": json.loads((run_dir / "crash.json").read_text()) if (run_dir / "crash.json").exists() else None,
            "reached": reached, "saved": {t: tasks[t]["saved"]["version"] or 0 for t in TENANTS},
            "statuses": {t: e["saved"]["status"] for t, e in tasks.items()},
            "errors": {t: e["saved"].get("error") for t, e in tasks.items()}}


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    """Runs the chain once; each test below checks one cell of it."""
    tmp_path = tmp_path_factory.mktemp("faults")
    config, run_dir, rng = _config(tmp_path), tmp_path / "run", random.Random(SEED)
    adapters = run_dir / "tasks" / "alice" / "add" / "adapters"
    no_disk = _mount_small_disk(adapters)
    cells: dict[str, dict] = {}
    job = None
    try:
        job = Job([str(config), "--run-dir", str(run_dir)], tmp_path)
        job.wait_lines("[broken] failed", "[lookup] failed")  # the task-level cells, before the first kill
        cells["env"] = _outcome(job, run_dir, _kill_cell(job, run_dir, "env", rng))
        cells["env"]["status"] = subprocess.run([sys.executable, "-m", "marlaas_hpc.cli", "status", str(run_dir)],
                                                cwd=ROOT, env=job_env(), capture_output=True, text=True, timeout=120)
        for role in ("rollout", "trainer follower, TP rank 1"):
            job = Job(["--resume", str(run_dir)], tmp_path)
            cells[role] = _outcome(job, run_dir, _kill_cell(job, run_dir, role, rng))
        corrupt = _corrupt_newest_shard(run_dir)
        job = Job(["--resume", str(run_dir)], tmp_path)
        cells["trainer leader"] = _outcome(job, run_dir, _kill_cell(job, run_dir, "trainer leader", rng))
        cells["corrupt"] = {**corrupt, "stdout": cells["trainer leader"]["stdout"]}
        job = Job(["--resume", str(run_dir)], tmp_path)
        cells["scheduler"] = _outcome(job, run_dir, _kill_cell(job, run_dir, "scheduler", rng))
        if no_disk is None:
            job = Job(["--resume", str(run_dir)], tmp_path)
            job.wait_steps(EVERY + rng.randint(0, 2))
            ballast = _fill(adapters, leave_bytes=64 * 1024)
            cells["disk"] = _outcome(job, run_dir, {"fault": "adapter directory full", "rank": 3,
                                                    "role": "trainer leader"})
            ballast.unlink()
        else:
            cells["disk"] = {"skipped": no_disk}
        job = Job(["--resume", str(run_dir)], tmp_path)
        cells["final"] = {"code": job.finish(), "output": job.output(), "stdout": list(job.lines)}
        cells["final"]["adapters"] = sorted(p.name for p in adapters.iterdir() if p.name.startswith("v"))
        print(_table(cells))  # shown with pytest -s: the matrix as it came out
        yield {"run_dir": run_dir, "cells": cells}
    finally:
        if job is not None and job.proc.poll() is None:  # a failed check left a run going: stop it
            job.proc.terminate()
            job.proc.wait(timeout=60)
        if no_disk is None:
            subprocess.run(["umount", "-l", str(adapters)], check=False)


def _table(cells: dict) -> str:
    rows = [f"fault matrix, seed {SEED}, checkpoint.every_steps={EVERY}",
            "| cell | exit (s after the kill) | message | add: reached -> resumes at | sort: reached -> resumes at |",
            "|---|---|---|---|---|"]
    first = cells.get("env", {}).get("stdout", [])
    for task_id, fault in (("broken", "reward function raises"), ("lookup", "tool hangs")):
        line = next((line for line in first if line.startswith(f"[{task_id}] failed")), "(none)")
        rows.append(f"| {fault} | - | {line} | - | - |")
    for name, cell in cells.items():
        if name == "corrupt":
            line = next((line for line in cell["stdout"] if cell["shard"] in line), "(none)")
            rows.append(f"| corrupt shard {cell['shard']} of add v{cell['version']} | - | {line} | - | - |")
        if "messages" not in cell:
            continue
        message = cell["messages"][0].split(": ", 1)[1].split("; no task")[0] if cell["messages"] else "(none)"
        stop = f" ({cell['stop_s']:.1f} s)" if cell["fault"].startswith("SIGKILL") else ""
        rows.append(f"| {cell['fault']} | {cell['code']}{stop} | {message} | " + " | ".join(
            f"v{cell['reached'][t]} -> v{cell['saved'][t]}" for t in TENANTS) + " |")
    return "\n".join(rows)


def _check_crash_cell(cell: dict, cause: str) -> None:
    assert cell["code"] not in (0, 75), cell["output"]
    assert len(cell["messages"]) == 1, f"seed {SEED}: one message, got:\n{cell['output']}"
    message = cell["messages"][0]
    assert f"rank {cell['rank']} ({cell['role']}" in message and cause in message, message
    assert "no task is at fault" in message and "marlaas run --resume" in message
    why = "Rank 0 runs the scheduler" if cell["rank"] == 0 else "The job stops without it: Open MPI v4"
    assert why in message, message
    assert cell["crash"]["rank"] == cell["rank"] and cell["crash"]["message"] == message
    assert cell["statuses"]["add"] in ("running", "done") and cell["statuses"]["sort"] in ("running", "done"), \
        "no training task is blamed"
    for task_id in TENANTS:
        lost = cell["reached"][task_id] - cell["saved"][task_id]
        assert 0 <= lost <= EVERY, f"seed {SEED}: {task_id} reached v{cell['reached'][task_id]} but resumes " \
                                   f"at v{cell['saved'][task_id]}"


@pytest.mark.parametrize("role", ["env", "rollout", "trainer follower, TP rank 1", "trainer leader", "scheduler"])
def test_sigkill_of_each_role_names_it_and_loses_at_most_one_interval(matrix, role):
    _check_crash_cell(matrix["cells"][role], "killed by signal 9 (SIGKILL)")


def test_status_of_a_crashed_run_dir_says_so(matrix):
    cell = matrix["cells"]["env"]
    assert cell["status"].returncode == 0
    assert "stopped by a crash (marlaas run --resume continues it)" in cell["status"].stdout
    assert cell["messages"][0] in cell["status"].stdout


def test_reward_that_raises_and_tool_that_hangs_fail_their_own_task_only(matrix):
    first = matrix["cells"]["env"]
    assert first["statuses"]["broken"] == "failed" and "verifier crashed on purpose" in first["errors"]["broken"]
    assert first["statuses"]["lookup"] == "failed" and "exceeded 3 s" in first["errors"]["lookup"]
    assert any("[broken] failed" in line for line in first["stdout"])
    assert any("[lookup] failed" in line for line in first["stdout"])
    summary = json.loads((matrix["run_dir"] / "summary.json").read_text())
    assert summary["tasks"]["broken"]["status"] == summary["tasks"]["lookup"]["status"] == "failed", \
        "they stay failed over the resumes; nothing else is failed"
    assert {t: s["status"] for t, s in summary["tasks"].items() if t in TENANTS} == {"add": "done", "sort": "done"}


def test_corrupt_checkpoint_falls_back_to_the_previous_one(matrix):
    corrupt = matrix["cells"]["corrupt"]
    previous = "its start (v0)" if corrupt["previous"] is None else f"its previous checkpoint v{corrupt['previous']}"
    notes = [line for line in corrupt["stdout"] if corrupt["shard"] in line]
    assert notes and "is corrupt" in notes[0] and f"add resumes from {previous}" in notes[0], corrupt["stdout"][:10]
    resumed = next(line for line in corrupt["stdout"] if line.startswith("[job] resuming"))
    assert f"add running v{corrupt['previous'] or 0}" in resumed


def test_full_disk_on_an_adapter_write_stops_the_job_naming_the_trainer_leader(matrix):
    cell = matrix["cells"]["disk"]
    if "skipped" in cell:
        pytest.skip(cell["skipped"])
    _check_crash_cell(cell, "No space left on device")
    assert "adapters" in cell["messages"][0]


def test_every_version_is_trained_exactly_once_over_all_runs(matrix):
    run_dir, final = matrix["run_dir"], matrix["cells"]["final"]
    assert final["code"] == 0, final["output"]
    summary = json.loads((run_dir / "summary.json").read_text())
    runs = summary["previous_runs"]
    assert [r["ended"] for r in runs] == ["crashed"] * len(runs) and len(runs) >= 5
    assert "rank 1 (env" in runs[0]["cause"]
    audit = [json.loads(line) for line in (run_dir / "audit.jsonl").read_text().splitlines()]
    config = yaml.safe_load((run_dir / "job.yaml").read_text())
    for task in config["tasks"]:
        task_id = task["task_id"]
        if task_id not in TENANTS:
            continue
        info = summary["tasks"][task_id]
        assert info["status"] == "done" and info["steps_done"] == STEPS
        rows = [r for r in audit if r["task_id"] == task_id]
        per_version = collections.Counter(r["trained_into"] for r in rows)
        group = task["algo"]["batch_prompts"] * task["algo"]["group_size"]
        assert per_version == {v: group for v in range(1, STEPS + 1)}, f"seed {SEED}"
        assert len({(r["group_id"], r["sample"]) for r in rows}) == len(rows), "no sample trained twice"
        for row in rows:
            assert row["trained_into"] - 1 - row["bound"] <= row["behaviour_version"] <= row["trained_into"] - 1
        metrics = run_dir / "tasks" / TENANTS[task_id] / task_id / "metrics.jsonl"
        assert [json.loads(line)["version"] for line in metrics.read_text().splitlines()] == \
            list(range(1, STEPS + 1))
    if "skipped" not in matrix["cells"]["disk"]:
        assert final["adapters"] == [f"v{v:04d}" for v in range(STEPS + 1)], "every adapter version on disk"
