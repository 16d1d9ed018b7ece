"""The `marlaas` command line: sbatch rendering of a job config, refusals before anything starts."""
import subprocess
import sys

from support.jobs import ROOT, marlaas


def test_sbatch_renders_a_four_component_hetjob_running_every_rank(tmp_path):
    proc = marlaas("sbatch", "configs/local-demo.yaml", "--run-dir", str(tmp_path / "run"))
    assert proc.returncode == 0, proc.stderr
    script = proc.stdout
    assert script.startswith("#!") and script.count("#SBATCH hetjob") == 3
    srun = next(line for line in script.splitlines() if " srun " in line and not line.startswith("#"))
    assert srun.startswith(f"{sys.executable} -m marlaas_hpc.launch.step_guard ")  # see launch/step_guard.py
    step = script[script.index(srun):].split(" || ")[0]  # the step's lines, one het component per line
    assert "--mpi=pmix" in srun and all(f"--het-group={i} --cpus-per-task=1" in step for i in range(4))
    assert "marlaas_hpc.runtime.main" in script and str(tmp_path / "run") in script
    assert "--signal=USR2@" in script


def test_sbatch_refuses_a_bad_layout(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text((ROOT / "configs" / "test-small.yaml").read_text().replace("trainer_tp: 2", "trainer_tp: 0"))
    proc = marlaas("sbatch", str(bad))
    assert proc.returncode == 2 and "layout.trainer_tp" in proc.stderr


def test_status_of_a_dir_that_is_not_a_run(tmp_path):
    proc = marlaas("status", str(tmp_path))
    assert proc.returncode == 2 and "no status.json" in proc.stderr


def test_gpu_config_renders_and_run_submit_refuse_its_placeholder_model(tmp_path):
    """configs/qwen3-0.6b-gsm8k.yaml ships with a placeholder checkpoint path: it renders, but neither runs nor
    submits (the check is JobConfig.model_path, before any process or Slurm call)."""
    proc = marlaas("sbatch", "configs/qwen3-0.6b-gsm8k.yaml", "--run-dir", str(tmp_path / "run"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("#SBATCH --gpus-per-task=1") == 1 and proc.stdout.count("#SBATCH hetjob") == 3
    assert proc.stdout.count("#SBATCH --gpus-per-node=2") == 1  # the TP=2 trainer: both GPUs of its node
    for command in ("run", "submit"):
        proc = marlaas(command, "configs/qwen3-0.6b-gsm8k.yaml", "--run-dir", str(tmp_path / "run"))
        assert proc.returncode == 2 and "model: '/path/to/Qwen3-0.6B' is not an HF checkpoint dir" \
            in proc.stderr, (command, proc.stderr)
    assert not (tmp_path / "run").exists(), "nothing written for a refused job"


def _run_dir(tmp_path, rank0_pid=None, **files):
    import json
    import socket

    run_dir = tmp_path / "run"
    (run_dir / "ranks").mkdir(parents=True)
    (run_dir / "job.json").write_text("{}")
    (run_dir / "status.json").write_text("{}")
    if rank0_pid is not None:
        (run_dir / "ranks" / "rank0.json").write_text(json.dumps({"rank": 0, "role": "scheduler", "pid": rank0_pid,
                                                                  "host": socket.gethostname()}))
    for name, data in files.items():
        (run_dir / f"{name}.json").write_text(json.dumps(data))
    return run_dir


def test_scale_refuses_a_job_that_is_not_running_and_says_why(tmp_path):
    """`marlaas scale` asks a live job's rank 0: a run dir whose job ended, crashed, was preempted, or whose rank 0
    is gone is refused, naming why, and nothing is written (it was accepted before)."""
    import time

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    cases = {
        "has ended (summary.json)": dict(summary={"preempted": False}),
        "was preempted and is not running": dict(summary={"preempted": True}),
        "was stopped by a crash (crash.json: marlaas: job stopped: rank 2": dict(
            crash={"message": "marlaas: job stopped: rank 2 (rollout) died"}),
        f"its rank 0 (pid {gone.pid}) has ended": dict(rank0_pid=gone.pid),
        "has not started (no ranks/rank0.json)": {},
    }
    for i, (why, setup) in enumerate(cases.items()):
        run_dir = _run_dir(tmp_path / str(i), **setup)
        if "crash" in setup:
            time.sleep(0.01)
            (run_dir / "crash.json").touch()
        proc = marlaas("scale", str(run_dir), "--rollout", "2")
        assert proc.returncode == 2 and why in proc.stderr, (why, proc.stderr)
        assert not (run_dir / "control").exists()


def test_scale_asks_a_live_jobs_rank_0(tmp_path):
    rank0 = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "marlaas_hpc.runtime.main"])
    try:
        run_dir = _run_dir(tmp_path, rank0_pid=rank0.pid)
        proc = marlaas("scale", str(run_dir), "--rollout", "2")
        assert proc.returncode == 0, proc.stderr
        assert (run_dir / "control" / "rollout.json").is_file()
    finally:
        rank0.kill()
        rank0.wait()
