"""Each rank's device binding is in CUDA_VISIBLE_DEVICES before MPI initialises (runtime/main.py
`bind_rank_device`): a CUDA-aware transport (UCX) may start CUDA inside MPI_Init, after which narrowing the variable
changes nothing.

An LD_PRELOAD shim (built here with mpicc) wraps MPI_Init and MPI_Init_thread through the MPI profiling interface
and writes, per rank, CUDA_VISIBLE_DEVICES as the real MPI_Init is entered; the ranks are the real
`python -m marlaas_hpc.runtime.main` under mpirun, started as `marlaas run` starts them. What this CPU cannot show:
CUDA actually starting inside MPI_Init (no CUDA-aware MPI, no CUDA here) and a GPU rank running on its GPU; the
first test emulates only the driver's device files, so its GPU ranks are refused once torch (a CPU build) is asked
for their GPU.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.mpi
ROOT = Path(__file__).resolve().parents[1]
SHIM = r"""
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>

/* MPI_INIT_RECORD_DIR/rank<world rank>: "=<CUDA_VISIBLE_DEVICES>" or "unset", as MPI_Init is entered */
static void record(void) {
    const char *dir = getenv("MPI_INIT_RECORD_DIR"), *rank = getenv("OMPI_COMM_WORLD_RANK");
    const char *cuda = getenv("CUDA_VISIBLE_DEVICES");
    char path[4096];
    if (!dir || !rank) return;
    snprintf(path, sizeof path, "%s/rank%s", dir, rank);
    FILE *out = fopen(path, "w");
    if (!out) return;
    fprintf(out, "%s%s\n", cuda ? "=" : "unset", cuda ? cuda : "");
    fclose(out);
}

int MPI_Init(int *argc, char ***argv) {
    record();
    return PMPI_Init(argc, argv);
}

int MPI_Init_thread(int *argc, char ***argv, int required, int *provided) {
    record();
    return PMPI_Init_thread(argc, argv, required, provided);
}
"""
GIVEN = "0,1,2,3"
"""CUDA_VISIBLE_DEVICES every rank is started with (as a node's launcher would hand it over)."""


@pytest.fixture(scope="module")
def shim(tmp_path_factory) -> Path:
    if shutil.which("mpicc") is None or shutil.which("mpirun") is None:
        pytest.skip("needs mpicc and mpirun (Debian: openmpi-bin libopenmpi-dev)")
    folder = tmp_path_factory.mktemp("mpi_init_shim")
    (folder / "shim.c").write_text(SHIM)
    subprocess.run(["mpicc", "-shared", "-fPIC", "-O2", "-o", str(folder / "shim.so"), str(folder / "shim.c")],
                   check=True, capture_output=True, timeout=120)
    return folder / "shim.so"


def _run_ranks(config: dict, tmp_path: Path, shim: Path, wrapper: tuple[str, ...] = ()):
    """The ranks of `config` under mpirun, as `marlaas run` starts them, with the shim preloaded into each rank;
    returns the process and {rank: CUDA_VISIBLE_DEVICES as MPI_Init was entered (None: unset)}."""
    from marlaas_hpc.cli import mpirun_command
    from marlaas_hpc.config import JobConfig

    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(config))
    job = JobConfig.load(path).validate()
    job.model_path()  # the tiny model, built (and cached) once here as `marlaas run` does
    record = tmp_path / "mpi_init"
    record.mkdir()
    command = mpirun_command(job, str(path), str(tmp_path / "run"), job.mode)
    command[1:1] = ["-x", f"LD_PRELOAD={shim}", "-x", f"MPI_INIT_RECORD_DIR={record}"]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=GIVEN, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT),
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    proc = subprocess.run([*wrapper, *command], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    seen = {int(p.name[4:]): p.read_text().strip() for p in record.iterdir()}
    return proc, {rank: None if text == "unset" else text[1:] for rank, text in seen.items()}


def _config(**layout) -> dict:
    config = yaml.safe_load((ROOT / "configs" / "test-small.yaml").read_text())  # 1 env, 1 rollout, TP=2
    config["layout"] = dict(config["layout"], **layout)
    config["fault"] = {"local_mpi": "system"}  # the shim is built with the system's mpicc, against its libmpi
    for task in config["tasks"]:
        task["total_steps"] = 1
    return config


def test_each_rank_sees_its_own_gpus_as_mpi_initialises_on_a_gpu_node(tmp_path, shim):
    """A node whose driver lists 4 GPUs (its /dev/nvidia0..3 device files, in a private /dev made by bubblewrap)
    and ranks handed CUDA_VISIBLE_DEVICES=0,1,2,3: at MPI_Init the scheduler and env ranks already see none, the
    rollout rank and the two TP ranks their own GPU of the node pool. torch here has no CUDA, so the GPU ranks are
    then refused, and rank 0 reports it."""
    if shutil.which("bwrap") is None:
        pytest.skip("needs bubblewrap (apt-get install bubblewrap) to give the ranks a /dev with GPU device files")
    fake_gpus = [arg for i in range(4) for arg in ("--ro-bind", "/dev/null", f"/dev/nvidia{i}")]
    wrapper = ("bwrap", "--bind", "/", "/", "--dev", "/dev", *fake_gpus, "--")
    proc, seen = _run_ranks(_config(), tmp_path, shim, wrapper)
    assert seen == {0: "", 1: "", 2: "0", 3: "1", 4: "2"}, (seen, proc.stderr[-3000:])
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    for rank, role, gpu in ((2, "rollout", 0), (3, "trainer", 1), (4, "trainer", 2)):
        assert (f"marlaas: layout.accelerator: rank {rank} ({role}) was given GPU(s) {gpu} but this torch build "
                "has no CUDA") in proc.stderr, proc.stderr[-3000:]


@pytest.mark.slow
def test_cpu_twin_ranks_hide_the_gpus_before_mpi_init_and_run(tmp_path, shim):
    """The driver lists no GPU (this machine): every rank runs on the CPU and already sees no GPU at MPI_Init,
    and the job runs to its end."""
    proc, seen = _run_ranks(_config(), tmp_path, shim)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert seen == {rank: "" for rank in range(5)}
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert {task: info["steps_done"] for task, info in summary["tasks"].items()} == {"add": 1, "sort": 1}
