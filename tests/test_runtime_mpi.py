"""The distributed runtime end to end under mpirun (local mode): scheduler, env, rollout and TP=2 trainer
ranks; staleness audit; adapters on disk; a failing task fails alone; bad layouts refused up front."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from support.configs import small_config
from support.jobs import ROOT, job_output, run_marlaas

pytestmark = [pytest.mark.mpi, pytest.mark.slow]


def _with_failing_rewards(config: dict, folder: Path) -> dict:
    """`config` with three tasks of tenant eve whose reward files (FILE.py:FUNCTION, no PYTHONPATH) raise, hang
    and eat memory."""
    (folder / "bad_reward.py").write_text(
        "def reward(sample, completion):\n    raise RuntimeError('verifier crashed on purpose')\n"
        "def hang(sample, completion):\n    while True:\n        pass\n"
        "def hog(sample, completion):\n    hoard = []\n    while True:\n        hoard.append(bytearray(2**26))\n")
    data = folder / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(40)))
    for task_id, function in (("broken", "reward"), ("hangs", "hang"), ("hog", "hog")):
        config["tasks"].append({"task_id": task_id, "tenant": "eve", "total_steps": 4,
                                "dataset": {"kind": "custom", "path": str(data),
                                            "reward_fn": f"{folder / 'bad_reward.py'}:{function}", "eval_size": 4},
                                "algo": {"group_size": 4, "batch_prompts": 4, "max_new_tokens": 4}})
    return config


@pytest.fixture(scope="module")
def small_run(tmp_path_factory, tiny_model_path):
    """configs/test-small.yaml (add and sort, bounds 0 and 2) beside three tasks whose rewards fail, run once; the
    tests below read it."""
    tmp_path = tmp_path_factory.mktemp("small_run")
    config = _with_failing_rewards(small_config(sandbox={"reward_timeout_s": 3, "reward_memory_mb": 256}), tmp_path)
    proc, run_dir = run_marlaas(config, tmp_path)
    assert proc.returncode == 0, job_output(proc)
    return proc, run_dir


def test_two_tasks_with_different_bounds_end_to_end(small_run, tiny_model_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    proc, run_dir = small_run
    assert "[add] v4/4" in proc.stdout and "[sort] v4/4" in proc.stdout  # progress shown
    noise = [line for line in proc.stderr.splitlines() if "Warning:" in line and "[W" not in line[:3]]
    assert not noise, noise  # quiet logs: no library's Python warnings between the progress lines (runtime/quiet.py)
    summary = json.loads((run_dir / "summary.json").read_text())
    tasks = {task_id: summary["tasks"][task_id] for task_id in ("add", "sort")}  # (the failing tasks: below)
    assert {t: s["status"] for t, s in tasks.items()} == {"add": "done", "sort": "done"}
    assert summary["mode"] == "async" and summary["wall_time_s"] > 0
    assert set(summary["busy_fraction"]) == {"env", "rollout", "trainer", "scheduler"}
    bounds = {"add": 0, "sort": 2}
    audit = [json.loads(line) for line in (run_dir / "audit.jsonl").read_text().splitlines()]
    for task_id, info in tasks.items():
        assert info["steps_done"] == 4 and info["staleness_bound"] == bounds[task_id]
        assert info["max_staleness_trained"] <= bounds[task_id]
        assert info["eval_accuracy_before"] is not None and info["eval_accuracy_after"] is not None
        assert info["ttfs_s"] > 0 and info["tpts_s"] > 0
        rows = [r for r in audit if r["task_id"] == task_id]
        assert len(rows) == info["trained_samples"] == 4 * 4 * 4  # steps x B x G
        for row in rows:
            assert row["trained_into"] - 1 - bounds[task_id] <= row["behaviour_version"] <= row["trained_into"] - 1
        assert sorted({r["trained_into"] for r in rows}) == [1, 2, 3, 4]
    status = subprocess.run([sys.executable, "-m", "marlaas_hpc.cli", "status", str(run_dir)], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert status.returncode == 0 and "finished" in status.stdout
    rows = {line.split()[0]: line.split() for line in status.stdout.splitlines()[2:]}
    assert rows["add"][1:5] == ["alice", "tiny", "done", "4/4"] and rows["sort"][1:5] == ["bob", "tiny", "done", "4/4"]
    metrics = [json.loads(line) for line in (run_dir / "tasks/bob/sort/metrics.jsonl").read_text().splitlines()]
    assert [m["version"] for m in metrics] == [1, 2, 3, 4]
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    for tenant, task_id in (("alice", "add"), ("bob", "sort")):
        adapters = sorted((run_dir / "tasks" / tenant / task_id / "adapters").iterdir())
        # the default retention (adapters: keep_last 2, keep_every 10): v0, the last two, the final one
        assert [a.name for a in adapters] == ["v0000", "v0003", "v0004"]
        model = PeftModel.from_pretrained(base, str(adapters[-1]), adapter_name=task_id)
        b_norm = sum(p.abs().sum().item() for n, p in model.named_parameters() if "lora_B" in n)
        assert b_norm > 0, "the final adapter is trained (non-zero B)"
        base = model.unload()


def test_failing_reward_fails_its_task_alone(small_run):
    """Reward files (FILE.py:FUNCTION, no PYTHONPATH) run in the env rank's sandboxed workers: one that raises, one
    that hangs and one that eats memory each fail their own task; the others finish."""
    _, run_dir = small_run
    tasks = json.loads((run_dir / "summary.json").read_text())["tasks"]
    assert {t: tasks[t]["status"] for t in ("broken", "hangs", "hog")} == dict.fromkeys(("broken", "hangs", "hog"),
                                                                                         "failed")
    assert "verifier crashed on purpose" in tasks["broken"]["error"]
    assert "did not return within 3 s" in tasks["hangs"]["error"], tasks["hangs"]["error"]
    assert "MemoryError" in tasks["hog"]["error"], tasks["hog"]["error"]
    assert tasks["add"]["status"] == tasks["sort"]["status"] == "done"
    assert tasks["add"]["steps_done"] == tasks["sort"]["steps_done"] == 4


@pytest.mark.parametrize("change, message", [
    ({"layout": {"env_ranks": 1, "rollout_ranks": 0, "trainer_tp": 2}}, "rollout_ranks"),
    ({"layout": {"env_ranks": 1, "rollout_ranks": 1, "trainer_tp": 2, "trainer": {"ntasks": 3}}}, "trainer"),
    ({"max_adapters": 1}, "adapter slots"),
    ({"engine": "tensorrt"}, "engine"),
])
def test_bad_layouts_refused_before_start(tmp_path, change, message):
    proc, run_dir = run_marlaas(small_config(**change), tmp_path, timeout=120)
    assert proc.returncode == 2
    assert "invalid config" in proc.stderr and message in proc.stderr
    assert not run_dir.exists(), "nothing started"


def test_share_gpus_trainers_build_their_models_after_every_engine_started(tmp_path, tiny_model_path):
    """layout.share_gpus: vLLM sizes its KV cache from the free memory it measures while it starts, so a trainer
    on the same GPU must not allocate meanwhile. Each rank's timeline keeps its start-up: every trainer rank's
    'build_model' begins after every rollout rank's 'start_engine' has ended (the same code runs on the CPU twin)."""
    config = small_config(layout={"env_ranks": 1, "rollout_ranks": 2, "trainer_tp": 1, "share_gpus": True})
    config["tasks"] = config["tasks"][:1]
    config["tasks"][0]["total_steps"] = 1
    proc, run_dir = run_marlaas(config, tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    spans = [json.loads(line) for path in (run_dir / "timeline").glob("rank*.jsonl")
             for line in path.read_text().splitlines()]
    engines = [s for s in spans if s["stage"] == "start_engine"]
    builds = [s for s in spans if s["stage"] == "build_model"]
    assert sorted(s["rank"] for s in engines) == [2, 3] and [s["rank"] for s in builds] == [4]
    assert min(s["start"] for s in builds) >= max(s["end"] for s in engines), (engines, builds)
