"""The LoRA delta broadcast group (runtime/delta.py) across processes: gloo on the CPU, NCCL with the buffer on
each member's own GPU, and gloo again when some member has no GPU of its own (a CPU rank, or two members on
one GPU under layout.share_gpus: NCCL refuses a duplicate GPU). Each case is tests/delta_scenarios.py under
mpirun, checking every received tensor bit for bit."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.mpi


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def run_delta(mode: str, ranks: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    proc = subprocess.run(["mpirun", "-np", str(ranks), "--oversubscribe", sys.executable,
                           str(ROOT / "tests" / "delta_scenarios.py"), mode], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_delta_broadcast_gloo_on_cpu():
    result = run_delta("cpu", 3)
    assert result == {"backend": "gloo", "ok": True, "buffer_devices": ["cpu", "cpu", "cpu"]}


@pytest.mark.gpu
@pytest.mark.skipif(_gpus() < 2, reason="needs 2 CUDA devices")
def test_delta_broadcast_nccl_on_gpus():
    result = run_delta("cuda", 2)
    assert result == {"backend": "nccl", "ok": True, "buffer_devices": ["cuda:0", "cuda:1"]}


@pytest.mark.gpu
@pytest.mark.skipif(_gpus() < 1, reason="needs a CUDA device")
@pytest.mark.parametrize("mode", ["mixed", "same_gpu"])
def test_delta_broadcast_falls_back_to_gloo_without_a_gpu_per_member(mode):
    result = run_delta(mode, 2)
    assert result == {"backend": "gloo", "ok": True, "buffer_devices": ["cpu", "cpu"]}
