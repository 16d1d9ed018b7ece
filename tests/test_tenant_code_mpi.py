"""A tenant brings a reward function to a running serving job (mpirun, local mode): `marlaas tasks add` of a spec
whose `dataset.reward_fn` is a file next to it (no PYTHONPATH for it anywhere). The task trains to the end with
its rewards computed in the env rank's sandboxed worker (the function checks its own confinement on every call
and would fail the task otherwise); a reward file that cannot load is refused at `tasks add`."""
import json
import os
import subprocess
import sys

import pytest
import yaml

from support.jobs import ROOT, job_env, live_tasks, marlaas, wait_for

pytestmark = [pytest.mark.mpi, pytest.mark.slow]

REWARD = '''
import os, socket, sys

def _confined():
    """Raises unless this runs inside the sandbox: no network, no /etc/shadow, no spawning."""
    for attempt in (lambda: socket.socket(), lambda: open("/etc/shadow"), lambda: os.posix_spawn(
            sys.executable, ["python", "-c", "pass"], {})):
        try:
            attempt()
        except OSError:
            continue
        raise RuntimeError("not sandboxed")

def score(sample, completion):
    _confined()
    answer = completion.strip()
    if answer == sample.answer:
        return 1.0
    return sum(a == b for a, b in zip(answer, sample.answer)) / (2 * max(len(sample.answer), 1))
'''


def test_serving_job_runs_a_reward_file_next_to_its_spec(tmp_path):
    tenant = tmp_path / "tenants" / "alice"
    tenant.mkdir(parents=True)
    (tenant / "reward.py").write_text(REWARD)
    (tenant / "sums.jsonl").write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n"
                                               for a in range(10) for b in range(1, 6)))
    spec = {"task_id": "sums", "tenant": "alice", "total_steps": 3, "max_staleness": 1,
            "dataset": {"kind": "custom", "path": "sums.jsonl", "reward_fn": "reward.py:score", "eval_size": 8},
            "lora": {"rank": 4, "alpha": 8}, "algo": {"group_size": 4, "batch_prompts": 4, "lr": 0.003,
                                                      "max_new_tokens": 4}}
    (tenant / "spec.yaml").write_text(yaml.safe_dump(spec))
    (tenant / "broken.py").write_text("import no_such_package\ndef score(sample, completion):\n    return 1.0\n")
    (tenant / "broken.yaml").write_text(yaml.safe_dump({**spec, "task_id": "broken",
                                                        "dataset": {**spec["dataset"], "reward_fn": "broken.py:score"}}))
    assert "PYTHONPATH" not in os.environ or str(tenant) not in os.environ["PYTHONPATH"]
    job = {"model": "tiny", "engine": "hf", "mode": "async", "max_adapters": 2, "rollout_slots": 4,
           "serve_idle_s": 300, "data_roots": [str(tmp_path / "tenants")],
           "sandbox": {"reward_timeout_s": 20, "reward_memory_mb": 1024},
           "layout": {"env_ranks": 1, "rollout_ranks": 1, "trainer_tp": 1},
           "tasks": [{"task_id": "base", "tenant": "ops", "total_steps": 3, "max_staleness": 1,
                      "dataset": {"kind": "addition", "eval_size": 8},
                      "algo": {"group_size": 4, "batch_prompts": 4, "lr": 0.003, "max_new_tokens": 6}}]}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "marlaas_hpc.cli", "run", str(tmp_path / "job.yaml"), "--run-dir",
                             str(run_dir)], cwd=ROOT, env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        wait_for(lambda: (run_dir / "job.json").is_file(), 600, "the job to start", proc)
        added = marlaas("tasks", "add", tenant / "spec.yaml", "--run", run_dir, timeout=300)
        assert added.returncode == 0, added.stderr
        refused = marlaas("tasks", "add", tenant / "broken.yaml", "--run", run_dir, timeout=300)
        assert refused.returncode == 2 and "dataset.reward_fn" in refused.stderr, refused.stderr
        assert "ModuleNotFoundError" in refused.stderr and "no_such_package" in refused.stderr
        wait_for(lambda: live_tasks(run_dir).get("sums", {}).get("status") in ("done", "failed"), 900,
                 "the tenant's task to end", proc)
        listing = marlaas("tasks", "ls", "--run", run_dir, timeout=300).stdout
        wait_for(lambda: live_tasks(run_dir).get("base", {}).get("status") in ("done", "failed"), 600,
                 "the base task to end", proc)
        assert marlaas("tasks", "close", "--run", run_dir, timeout=300).returncode == 0
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out[-3000:]
    tasks = json.loads((run_dir / "summary.json").read_text())["tasks"]
    sums = tasks["sums"]
    assert sums["status"] == "done" and sums["steps_done"] == 3 and sums["error"] is None, (sums, out[-3000:])
    assert "broken" not in tasks
    assert sums["eval_accuracy_before"] is not None and sums["eval_accuracy_after"] is not None
    metrics = [json.loads(line) for line in (run_dir / "tasks/alice/sums/metrics.jsonl").read_text().splitlines()]
    assert [m["version"] for m in metrics] == [1, 2, 3]
    assert all(0.0 <= m["reward_mean"] <= 1.0 for m in metrics)
    assert "sums" in listing and "alice" in listing
    print(f"\n[tenant-code] sums: rewards {[round(m['reward_mean'], 3) for m in metrics]}, eval "
          f"{sums['eval_accuracy_before']:.3f} -> {sums['eval_accuracy_after']:.3f}")
