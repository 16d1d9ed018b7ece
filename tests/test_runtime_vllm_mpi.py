"""The distributed runtime with the vLLM engine (local mode, mpirun): the job config's `vllm:` settings reach
every rollout rank's engine, the device binding puts every rank on the CPU here, and the job trains."""
import json

import pytest

from test_runtime_mpi import run_marlaas, small_config

pytestmark = [pytest.mark.mpi, pytest.mark.slow, pytest.mark.vllm]


def test_vllm_settings_reach_the_rollout_engine(tmp_path, tiny_model_path, monkeypatch):
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "INFO")  # vLLM logs its engine config at start
    config = small_config(engine="vllm", max_adapters=2,
                          vllm={"max_model_len": 96, "max_num_seqs": 24, "max_loras": 2, "max_cpu_loras": 3,
                                "enable_prefix_caching": False, "cpu_kv_cache_gib": 1})
    config["tasks"] = config["tasks"][:1]
    config["tasks"][0]["total_steps"] = 2
    proc, run_dir = run_marlaas(config, tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "[device] every rank on the CPU (layout.accelerator 'auto': no GPU visible)" in proc.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["tasks"]["add"]["status"] == "done" and summary["tasks"]["add"]["steps_done"] == 2
    log = proc.stdout + proc.stderr
    assert "max_seq_len=96" in log and "enable_prefix_caching=False" in log, log[-4000:]
