"""A vLLM engine whose core runs in a process of its own (rollout/vllm_engine.py `start_llm`, what a GPU rank of
several models runs): when the rank that owns it is killed (mpirun kills the ranks of a job that fails), the
processes vLLM spawned for it die too (rollout/vllm_plugin.py: PR_SET_PDEATHSIG), instead of living on, orphaned,
holding the job's output pipes open so that the job never ends."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm
ROOT = Path(__file__).resolve().parents[1]
OWNER = """
import os, sys, time

def main():
    from marlaas_hpc.rollout import make_engine
    engine = make_engine("vllm", sys.argv[1], work_dir=sys.argv[2], kv_cache_gib=1 / 16, own_process=True,
                         warmup=False)
    print("UP", flush=True)
    time.sleep(600)

if __name__ == "__main__":  # vLLM spawns its core: the main module is imported there again
    main()
"""


def _descendants(pid: int) -> list:
    import psutil

    return psutil.Process(pid).children(recursive=True)


def test_the_engine_processes_die_with_the_rank_that_owns_them(tiny_model_path, tmp_path):
    pytest.importorskip("vllm")
    script = tmp_path / "owner.py"
    script.write_text(OWNER)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    owner = subprocess.Popen([sys.executable, str(script), str(tiny_model_path), str(tmp_path / "engine")],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        assert any(line.strip() == "UP" for line in owner.stdout), "the engine started"  # (vLLM logs to stdout)
        spawned = [p for p in _descendants(owner.pid) if "VLLM" in p.name()]
        assert len(spawned) >= 1, "vLLM's engine core runs in a process of its own"
        owner.send_signal(signal.SIGKILL)
        owner.wait(timeout=30)
        deadline = time.monotonic() + 30
        while any(p.is_running() and p.status() != "zombie" for p in spawned) and time.monotonic() < deadline:
            time.sleep(0.2)
        alive = [p.name() for p in spawned if p.is_running() and p.status() != "zombie"]
        assert not alive, f"orphaned engine processes: {alive}"
    finally:
        owner.kill()
        for process in _descendants(os.getpid()):
            if "VLLM" in process.name():
                process.kill()
