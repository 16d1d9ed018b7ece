"""Against a real Slurm (the single-machine cluster of slurm/local-cluster/start.sh): 4-component het jobs
through HetJobExecutor and through the plain sbatch script, and USR2 checkpoint -> requeue -> resume.

Needs partitions `cpu` and `gpu` with at least 2 idle nodes each (het components never share a node).
"""
from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

import cloudpickle
import pytest
import yaml

from marlaas_hpc.launch.layout import ComponentResources, JobLayout, LayoutError, assign_role
from marlaas_hpc.launch.probe import RequeueProbe, hetjob_probe
from marlaas_hpc.launch.sbatch import check_partitions, render_sbatch
from marlaas_hpc.launch.submitit_hetjob import HetJobExecutor
from support.slurm import cluster, mpi_init_crashed, retry_note, sacct_states  # noqa: F401 (cluster: a fixture)

pytestmark = pytest.mark.slurm
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # functions submitted from here travel by value


def _hung_after_the_probe(log: Path, world_size: int) -> bool:
    """Every rank printed its probe line, yet the step did not end (seen once in a loaded CI run: a rank stuck
    in MPI finalization on the emulated cluster; the same job then passed in 4 s)."""
    text = log.read_text(errors="replace") if log.exists() else ""
    return sum(line.startswith('{"cpus"') for line in text.splitlines()) == world_size  # the probe's sorted keys


def _layout(**overrides) -> JobLayout:
    """1 control + 1 env + 2 rollout + 2 trainer (TP=2), GPU parts on the fake-GPU partition."""
    fields = dict(env_ranks=1, rollout_ranks=2, trainer_tp=2, time=60, emulated_nodes=True, srun_grace_s=10,
                  exports={"OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}, signal_lead_s=30,
                  control=ComponentResources(partition="cpu"), env=ComponentResources(partition="cpu"),
                  rollout=ComponentResources(partition="gpu", gpus_per_task=1),
                  trainer=ComponentResources(partition="gpu", gpus_per_task=1))
    fields.update(overrides)
    return JobLayout(**fields).validate()


def _wait_sacct(job_id: str, timeout_s: float) -> list[str]:
    """sacct states of the het components once all 4 ended (or at the deadline, after scancel)."""
    deadline = time.monotonic() + timeout_s
    states: list[str] = []
    while time.monotonic() < deadline:
        states = sacct_states(job_id)
        if len(states) == 4 and not any(s.split()[0] in ("PENDING", "RUNNING", "COMPLETING", "REQUEUED")
                                        for s in states):
            return states
        time.sleep(0.5)
    subprocess.run(["scancel", job_id], check=False)
    return states


def _wait_completed(job_id: str, timeout_s: float) -> list[str]:
    states = _wait_sacct(job_id, timeout_s)
    assert states == ["COMPLETED"] * 4, f"job {job_id} did not complete: sacct states {states}"
    return states


def _wait_done(job, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not job.done():
        if time.monotonic() > deadline:
            job.cancel(check=False)
            pytest.fail(f"job {job.job_id} not done after {timeout_s}s; state {job.state}; rank 0 log:\n"
                        f"{job.stderr()}")
        time.sleep(0.5)


def _placed_layout() -> JobLayout:
    """_layout() with CPUs per rank that differ by component (each node of the local cluster has the machine's 2
    CPUs). The control component also holds its node exclusively: on a 2-CPU node that is where the srun line
    matters, since without its own --cpus-per-task the step's one task got both CPUs of the allocation."""
    return _layout(control=ComponentResources(partition="cpu", cpus_per_task=1, extra_sbatch=["--exclusive"]),
                   env=ComponentResources(partition="cpu", cpus_per_task=2))


def _check_placement(layout: JobLayout, views: list[dict]) -> None:
    """Each rank runs on exactly its component's CPUs per task; the rollout ranks see their own (fake) GPU (per
    task), the two TP ranks of the trainer both GPUs of their node (per node: NCCL keeps NVLink between them),
    and the binding rule gives each TP rank its own GPU, narrowed to it."""
    from marlaas_hpc.launch.devices import bind_device

    by_rank = sorted(views, key=lambda view: view["rank"])
    assert [v["cpus"] for v in by_rank] == [layout.resources(assign_role(v["rank"], layout).component).cpus_per_task
                                            for v in by_rank], [(v["rank"], v["cpus"]) for v in by_rank]
    assert [v["cuda_visible_devices"] for v in by_rank][2:] == ["0", "1", "0,1", "0,1"]
    bindings = [bind_device(v["environ"], v["rank"], layout, driver_gpus=4) for v in by_rank[4:]]
    assert [(b.gpus, b.cuda_visible_devices) for b in bindings] == [(("0",), "0"), (("1",), "1")]
    assert all(b.how.startswith("node pool of 2") for b in bindings)


def test_submitit_hetjob_runs_one_mpi_world_with_layout_roles(cluster, tmp_path):
    layout = _placed_layout()
    for attempt in range(2):
        folder = tmp_path / f"submitit{attempt}"
        executor = HetJobExecutor(folder, layout)
        executor.update_parameters(job_name="probe")
        job = executor.submit(hetjob_probe, layout)
        _wait_done(job, 90)
        if attempt == 0 and _wait_sacct(job.job_id, 30) != ["COMPLETED"] * 4 \
                and mpi_init_crashed(list(folder.glob("*_log.err"))):
            retry_note(job.job_id)
            continue
        break
    results = job.results()  # every rank's return value, through submitit
    assert len(results) == layout.world_size == 6
    for rank, view in enumerate(results):
        role = assign_role(rank, layout)
        assert view["rank"] == rank and view["world_size"] == 6
        assert (view["role"], view["role_index"], view["slurm_component"]) == (role.kind, role.index, role.component)
        assert view["job_id"] == job.job_id  # the leader's id in every component
        assert view["rendezvous_host"] == results[0]["node"]  # first step host = rank 0's node
    assert [v["node"][0] for v in results] == ["c", "c", "g", "g", "g", "g"]
    _check_placement(layout, results)
    assert results[0]["world_roles"] == [("scheduler", 0, 0), ("env", 0, 1), ("rollout", 0, 2), ("rollout", 1, 2),
                                         ("trainer", 0, 3), ("trainer", 1, 3)]
    assert _wait_completed(job.job_id, 30) == ["COMPLETED"] * 4
    assert job.watcher.get_state(job.job_id, mode="force") == "COMPLETED"  # het rows folded by our watcher


def test_plain_sbatch_script_runs_the_same_probe(cluster, tmp_path):
    layout = _placed_layout()
    layout_file = tmp_path / "layout.yaml"
    layout_file.write_text(yaml.safe_dump(layout.to_dict()))
    script = tmp_path / "job.sbatch"
    script.write_text(render_sbatch(layout, f"{sys.executable} -m marlaas_hpc.launch.probe {layout_file}",
                                    "probe-sbatch", tmp_path))
    for attempt in range(2):
        out = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, check=True)
        job_id = out.stdout.strip().split(";")[0]
        log_file = tmp_path / f"probe-sbatch-{job_id}.out"
        if attempt == 0 and _wait_sacct(job_id, 90) != ["COMPLETED"] * 4:
            if mpi_init_crashed([log_file]):
                retry_note(job_id)
                continue
            if _hung_after_the_probe(log_file, layout.world_size):
                print(f"\n[slurm test] job {job_id}: every rank reported, but the step did not end; retrying once")
                continue
        break
    _wait_completed(job_id, 90)
    log = log_file.read_text()
    views = _json_objects(log)
    assert sorted(v["rank"] for v in views) == list(range(6))
    assert all(v["role"] == assign_role(v["rank"], layout).kind for v in views)
    _check_placement(layout, views)


def _json_objects(text: str) -> list[dict]:
    """JSON objects in a step log; srun merges the ranks' outputs without keeping line boundaries."""
    decoder, found, at = json.JSONDecoder(), [], text.find("{")
    while at >= 0:
        obj, end = decoder.raw_decode(text, at)
        found.append(obj)
        at = text.find("{", end)
    return found


def rank_leaving_a_thread() -> int:
    """A rank that started MPI and leaves a non-daemon thread running, as a rollout rank leaves vLLM's engine and
    NCCL's threads: Python's own exit would wait for it forever."""
    import threading

    from mpi4py import MPI

    threading.Thread(target=threading.Event().wait, daemon=False).start()
    comm = MPI.COMM_WORLD
    return comm.allreduce(1) * 100 + comm.Get_rank()


def test_submit_ranks_end_through_end_rank_once_their_results_are_written(cluster, tmp_path):
    """The executor of `marlaas submit` (every rank runs marlaas_hpc.submit.rank_main): each rank's result is
    written, then the rank ends through end_rank (MPI finalized, os._exit) and the job completes; ended by the
    interpreter instead, the ranks hung at exit and the job held its nodes until the time limit."""
    from marlaas_hpc.submit import het_executor

    layout = _layout()
    for attempt in range(2):
        folder = tmp_path / f"submit{attempt}"
        executor = het_executor(folder, layout)
        executor.update_parameters(job_name="ends")
        job = executor.submit(rank_leaving_a_thread)
        _wait_done(job, 90)
        states = _wait_sacct(job.job_id, 60)
        if attempt == 0 and states != ["COMPLETED"] * 4 and mpi_init_crashed(list(folder.glob("*_log.err"))):
            retry_note(job.job_id)
            continue
        break
    assert job.results() == [600 + rank for rank in range(6)]
    assert states == ["COMPLETED"] * 4, states


def test_unknown_partition_is_refused_before_submission(cluster):
    with pytest.raises(LayoutError, match="unknown partition 'a100'") as info:
        check_partitions(_layout(trainer=ComponentResources(partition="a100", gpus_per_task=1)))
    assert info.value.field == "trainer.partition"


def test_usr2_checkpoints_requeues_and_resumes(cluster, tmp_path):
    layout = _layout(rollout_ranks=1, trainer_tp=1)  # 1+1+1+1
    state = tmp_path / "state"
    state.mkdir()
    executor = HetJobExecutor(tmp_path / "submitit", layout)
    executor.update_parameters(job_name="requeue")
    job = executor.submit(RequeueProbe(), str(state), 120.0)
    deadline = time.monotonic() + 60
    while len(list(state.glob("READY.*"))) < 4:  # every rank's handler is set
        assert time.monotonic() < deadline, f"first run never got ready; rank 0 log:\n{job.stderr()}"
        time.sleep(0.2)
    assert json.loads((state / "state.json").read_text())["written_at_restart"] == 0
    t0 = time.monotonic()
    subprocess.run(["scancel", "--signal=USR2", job.job_id], check=True)
    _wait_done(job, 100)
    requeue_s = time.monotonic() - t0
    results = job.results()
    assert (state / "CHECKPOINTED").exists()  # submitit called our checkpoint() on rank 0
    assert [r["restart_count"] for r in results] == [1] * 4
    assert results[0]["saved"] == {"written_at_restart": 0, "step": 41}
    assert _wait_completed(job.job_id, 30) == ["COMPLETED"] * 4
    print(f"USR2 -> requeue -> rerun complete in {requeue_s:.1f} s")


@pytest.mark.parametrize("task_status", [0, 3])
def test_step_guard_ends_an_srun_that_outlives_its_step(cluster, tmp_path, task_status):
    """Slurm 22.05 here sometimes leaves srun of a finished het step running (the batch script then holds
    the allocation to the time limit). That cannot be provoked on demand, so the guarded command is a real
    het step followed by a process that does not exit, as a hung srun would not."""
    hung_srun = (f"srun --het-group=0-1 --unbuffered bash -c 'sleep 2; exit {task_status}'; "
                 "echo step over, srun hangs; exec sleep 600")
    script = tmp_path / "guard.sbatch"
    script.write_text(f"""#!/bin/bash
#SBATCH --partition=cpu --ntasks=1 --time=5 --output={tmp_path}/guard-%j.out
#SBATCH hetjob
#SBATCH --partition=cpu --ntasks=1 --time=5
{sys.executable} -m marlaas_hpc.launch.step_guard --poll=0.5 --grace=3 -- bash -c {shlex.quote(hung_srun)}
""")
    job_id = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True,
                            check=True).stdout.strip().split(";")[0]
    t0 = time.monotonic()
    deadline = t0 + 90
    while sacct_states(job_id)[:1] in ([], ["PENDING"], ["RUNNING"], ["COMPLETING"]):
        if time.monotonic() > deadline:
            subprocess.run(["scancel", job_id], check=False)
            pytest.fail(f"job {job_id} still running 90 s after submission; log:\n"
                        f"{(tmp_path / f'guard-{job_id}.out').read_text(errors='replace')}")
        time.sleep(0.5)
    ended_s = time.monotonic() - t0
    log = (tmp_path / f"guard-{job_id}.out").read_text(errors="replace")
    assert "step over, srun hangs" in log and "stopping it" in log, log
    assert f"step {job_id}.0 ended with status {task_status} (sacct)" in log, log
    rows = subprocess.run(["sacct", "-n", "-X", "-P", "-o", "JobID,State,ExitCode", "-j", job_id],
                          capture_output=True, text=True, check=True).stdout.split()
    leader = rows[0].split("|")
    assert leader[1] == ("COMPLETED" if task_status == 0 else "FAILED") and leader[2] == f"{task_status}:0", rows
    print(f"hung srun ended by the guard {ended_s:.1f} s after submission (grace 3 s)")
