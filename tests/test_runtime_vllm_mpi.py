"""The distributed runtime with the vLLM engine (local mode, mpirun): the job config's `vllm:` settings reach
every rollout rank's engine, the device binding puts every rank on the CPU here, and the job trains, its rollout
rank loading every adapter version from memory (no directory per version under RUN_DIR/rollout/, ever)."""
import json
import re
import threading
import time
from contextlib import contextmanager

import pytest

from support.checks import assignment_followed
from support.configs import MODEL_OF, multi_model_demo, small_config
from support.jobs import run_marlaas

pytestmark = [pytest.mark.mpi, pytest.mark.slow, pytest.mark.vllm]


@contextmanager
def adapter_files_seen(run_dir):
    """Polls RUN_DIR/rollout/ while the job runs; yields the set of per-version dirs and adapter files ever seen
    there (a copy would live from its delta until its version is retired: seconds, far over the poll period)."""
    seen, stop = set(), threading.Event()

    def poll():
        while not stop.is_set():
            for path in (run_dir / "rollout").rglob("*"):
                if re.fullmatch(r"\.?v\d{4,}.*", path.name) or path.name.startswith("adapter_"):
                    seen.add(str(path.relative_to(run_dir)))
            time.sleep(0.02)

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    try:
        yield seen
    finally:
        stop.set()
        thread.join()


def test_vllm_settings_reach_the_rollout_engine(tmp_path, tiny_model_path, monkeypatch):
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "INFO")  # vLLM logs its engine config at start
    config = small_config(engine="vllm", max_adapters=2,
                          vllm={"max_model_len": 96, "max_num_seqs": 24, "max_loras": 2, "max_cpu_loras": 3,
                                "enable_prefix_caching": False, "cpu_kv_cache_gib": 1})
    config["tasks"] = config["tasks"][:1]
    config["tasks"][0]["total_steps"] = 2
    with adapter_files_seen(tmp_path / "run") as seen:
        proc, run_dir = run_marlaas(config, tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert not seen, f"a rollout rank wrote adapter versions to disk: {sorted(seen)[:5]}"
    loads = [json.loads(line) for path in (run_dir / "timeline").glob("rank*.jsonl")
             for line in path.read_text().splitlines() if '"load_delta"' in line]
    assert sorted(r["version"] for r in loads if r["stage"] == "load_delta") == [0, 1, 2], "every version landed"
    assert "[device] every rank on the CPU (layout.accelerator 'auto': no GPU visible)" in proc.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["tasks"]["add"]["status"] == "done" and summary["tasks"]["add"]["steps_done"] == 2
    log = proc.stdout + proc.stderr
    assert "max_seq_len=96" in log and "enable_prefix_caching=False" in log, log[-4000:]
    # quiet logs (runtime/quiet.py, the engine's use_tqdm_on_load): no weight-loading bar, no C++ NUMA notice
    assert "Loading safetensors" not in log and "NUMA binding" not in log, log[-4000:]


def test_a_rank_of_two_models_runs_each_vllm_engine_in_a_process_of_its_own(tmp_path):
    """vllm.engine_process 'own' (what 'auto' picks on a GPU rank of several models, vLLM's sleep mode acting on a
    whole process): the demo's two models on one rollout rank, each vLLM engine core spawned by vLLM from the MPI
    rank. The rank switches between them as rank 0 says, every task trains to its last step, every version once,
    and the job's output stays quiet (no traceback, no library notice from the spawned processes)."""
    import collections

    config = multi_model_demo(tiny_steps=2)  # short: 2 steps of 4 prompts, 8 eval prompts
    config["engine"], config["vllm"] = "vllm", {"engine_process": "own", "cpu_kv_cache_gib": 0.25}
    proc, run_dir = run_marlaas(config, tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert all(s["status"] == "done" and s["steps_done"] == 2 for s in summary["tasks"].values()), summary["tasks"]
    audit = [json.loads(line) for line in (run_dir / "audit.jsonl").read_text().splitlines()]
    for task in config["tasks"]:
        trained = collections.Counter(r["trained_into"] for r in audit if r["task_id"] == task["task_id"])
        assert trained == {v: task["algo"]["batch_prompts"] * task["algo"]["group_size"] for v in (1, 2)}
    (rank, switches), = summary["model_switches"].items()
    assert switches["switches"] >= 1
    assert set(assignment_followed(run_dir)[int(rank)]) == set(MODEL_OF.values())
    log = proc.stdout + proc.stderr
    assert "Traceback" not in log and "Triton" not in log and "NUMA binding" not in log, log[-4000:]
