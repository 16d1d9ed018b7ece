"""Rendered het-job scripts: plain sbatch (slurm/hetjob.sbatch.j2) and submitit's, golden-file tested.

Regenerate the golden files after an intended change: MARLAAS_UPDATE_GOLDEN=1 pytest tests/test_launch_sbatch.py
"""
from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from marlaas_hpc.launch.layout import ComponentResources, JobLayout, LayoutError
from marlaas_hpc.launch.sbatch import check_partitions, component_options, render_sbatch, slurm_time
from marlaas_hpc.launch.submitit_hetjob import HetJobExecutor, HetJobInfoWatcher, fold_states

GOLDEN = Path(__file__).parent / "golden"
SHIPPED = {"qwen3_0.6b": Path(__file__).parents[1] / "configs" / "qwen3-0.6b-gsm8k.yaml"}
"""Shipped job configs whose layouts are golden-tested too (loaded as `marlaas sbatch` loads them)."""
LAYOUTS = ["cpu_small", "gpu_tp4", "gpu_groups2", *SHIPPED]
COMMAND = ("python -m marlaas_hpc.runtime.main /scratch/marlaas/job.yaml --run-dir /scratch/marlaas/runs/demo "
           "--auto-resume")
FOLDER = "/scratch/marlaas/runs/demo"
PYTHON = "/opt/marlaas/.venv/bin/python"


def _layout(name: str) -> JobLayout:
    if name in SHIPPED:
        from marlaas_hpc.config import JobConfig

        return JobConfig.load(SHIPPED[name]).layout
    return JobLayout.from_dict(yaml.safe_load((GOLDEN / f"layout_{name}.yaml").read_text()))


def _check_golden(text: str, path: Path) -> None:
    if os.environ.get("MARLAAS_UPDATE_GOLDEN"):
        path.write_text(text)
    assert path.exists(), f"{path} missing: run with MARLAAS_UPDATE_GOLDEN=1 once"
    assert text == path.read_text(), f"rendered text differs from {path.name} (MARLAAS_UPDATE_GOLDEN=1 to accept)"


def sbatch_header(text: str) -> list[str]:
    """The #SBATCH lines sbatch reads: it stops at the first line that is neither blank nor a comment."""
    header = []
    for line in text.splitlines()[1:]:
        if line.strip() and not line.startswith("#"):
            break
        if line.startswith("#SBATCH"):
            header.append(line)
    return header


def _blocks(header: list[str]) -> list[list[str]]:
    blocks: list[list[str]] = [[]]
    for line in header:
        if line == "#SBATCH hetjob":
            blocks.append([])
        else:
            blocks[-1].append(line)
    return blocks


def _executor(layout: JobLayout, monkeypatch) -> HetJobExecutor:
    monkeypatch.setattr(HetJobExecutor, "affinity", classmethod(lambda cls: 2))  # no srun needed to render
    executor = HetJobExecutor(FOLDER, layout, python=PYTHON)
    executor.update_parameters(job_name="demo")
    return executor


@pytest.mark.parametrize("name", LAYOUTS)
def test_render_sbatch_golden(name):
    text = render_sbatch(_layout(name), COMMAND, "demo", FOLDER, f"{FOLDER}/checkpoint/REQUEUE", python=PYTHON)
    _check_golden(text, GOLDEN / f"sbatch_{name}.sbatch")


@pytest.mark.parametrize("name", LAYOUTS)
def test_submitit_script_golden(name, monkeypatch):
    text = _executor(_layout(name), monkeypatch)._make_submission_file_text(
        "/opt/marlaas/.venv/bin/python -u -m marlaas_hpc.launch.hetjob_task /scratch/marlaas/runs/demo", "uid")
    _check_golden(text, GOLDEN / f"submitit_{name}.sh")


@pytest.mark.parametrize("kind", ["sbatch", "submitit"])
@pytest.mark.parametrize("name", LAYOUTS)
def test_scripts_are_four_component_hetjobs(name, kind, monkeypatch):
    layout = _layout(name)
    if kind == "sbatch":
        text = render_sbatch(layout, COMMAND, "demo", FOLDER)
    else:
        executor = _executor(layout, monkeypatch)
        text = executor._make_submission_file_text(executor._submitit_command_str, "uid")
    header = sbatch_header(text)
    assert sum("#SBATCH" in line for line in text.splitlines()) == len(header), "#SBATCH line after a command"
    blocks = _blocks(header)
    assert len(blocks) == 4
    for i, block in enumerate(blocks):
        assert f"#SBATCH --ntasks={layout.component_sizes[i]}" in block
        assert any(line.startswith("#SBATCH --signal=USR2@") for line in block)
    srun = _step(text)
    assert srun.startswith(f"{PYTHON if kind == 'submitit' else sys.executable} -m marlaas_hpc.launch.step_guard "
                           f"--grace={layout.srun_grace_s} -- srun --unbuffered ")
    assert f"--mpi={layout.mpi}" in srun and "--kill-on-bad-exit=1" in srun
    assert "%t" not in srun and "%j" not in srun  # wrong in a het step (see submitit_hetjob.py)
    body = text.splitlines()
    assert body.index("set -euo pipefail") < body.index(srun.splitlines()[0])
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)


def _step(text: str) -> str:
    """The srun step of a script: its first line up to the end of its continuation lines."""
    lines = text.splitlines()
    first = next(i for i, line in enumerate(lines) if " srun " in line and not line.startswith("#"))
    last = next(i for i in range(first, len(lines)) if not lines[i].endswith("\\"))
    return "\n".join(lines[first:last + 1])


def _srun_argv(text: str) -> list[str]:
    """srun's arguments in a script's step, as bash splits them (the step guard's own come before `srun`)."""
    argv = shlex.split(_step(text).split(" || ")[0].replace("\\\n", " "))  # bash drops backslash-newline
    return argv[argv.index("srun") + 1:]


def _script(kind: str, layout: JobLayout, monkeypatch) -> str:
    if kind == "sbatch":
        return render_sbatch(layout, COMMAND, "demo", FOLDER)
    executor = _executor(layout, monkeypatch)
    return executor._make_submission_file_text(executor._submitit_command_str, "uid")


@pytest.mark.parametrize("kind", ["sbatch", "submitit"])
@pytest.mark.parametrize("name", LAYOUTS)
def test_every_component_gets_its_cpus_on_the_srun_line(name, kind, monkeypatch):
    """Since Slurm 22.05 srun does not take --cpus-per-task from the allocation: the step gives each het
    component its own part, `--het-group=<i> --cpus-per-task=<the component's>`, separated by ':', and the one
    command after the last part runs in all of them (one MPI_COMM_WORLD, checked on the local cluster)."""
    layout = _layout(name)
    argv = _srun_argv(_script(kind, layout, monkeypatch))
    parts, part = [], []
    for arg in argv:
        if arg == ":":
            parts.append(part)
            part = []
        else:
            part.append(arg)
    parts.append(part)
    assert len(parts) == 4
    for i, (part, component) in enumerate(zip(parts, ("control", "env", "rollout", "trainer"))):
        options = [arg for arg in part if arg.startswith("--het-group") or arg.startswith("--cpus-per-task")]
        assert options == [f"--het-group={i}", f"--cpus-per-task={layout.resources(component).cpus_per_task}"]
    assert [arg for arg in parts[-1] if not arg.startswith("--")][:3] == (
        ["python", "-m", "marlaas_hpc.runtime.main"] if kind == "sbatch"
        else [PYTHON, "-u", "-m"])  # the command once, after the last part


@pytest.mark.parametrize("kind", ["sbatch", "submitit"])
def test_a_tp_trainer_asks_for_its_gpus_per_node(kind, monkeypatch):
    """A trainer TP group spanning ranks asks Slurm for GPUs per node, not per task: per task, sites that confine
    devices per task show each rank only its own GPU and NCCL loses NVLink between TP ranks. Engines keep theirs
    per task, and so does a TP=1 trainer."""
    for name, per_node in (("gpu_tp4", 4), ("qwen3_0.6b", 2)):
        trainer = _blocks(sbatch_header(_script(kind, _layout(name), monkeypatch)))[3]
        assert f"#SBATCH --gpus-per-node={per_node}" in trainer and f"#SBATCH --ntasks-per-node={per_node}" in trainer
        assert not any("--gpus-per-task" in line or "--gpu-bind" in line for line in trainer)
        rollout = _blocks(sbatch_header(_script(kind, _layout(name), monkeypatch)))[2]
        assert any(line.startswith("#SBATCH --gpus-per-task=") for line in rollout)
    tp1 = JobLayout(trainer_dp=2, trainer=ComponentResources(gpus_per_task=1)).validate()
    trainer = _blocks(sbatch_header(_script(kind, tp1, monkeypatch)))[3]
    assert "#SBATCH --gpus-per-task=1" in trainer and not any("--gpus-per-node" in line for line in trainer)


def test_emulated_node_settings_only_when_configured():
    small, gpu = _layout("cpu_small"), _layout("gpu_tp4")
    assert "export OMPI_MCA_btl=self,tcp" in render_sbatch(small, COMMAND, "demo", FOLDER)
    text = render_sbatch(gpu, COMMAND, "demo", FOLDER)
    assert "OMPI_MCA_btl=" not in text and "OMPI_MCA_pml" not in text
    assert "export NCCL_SOCKET_IFNAME=ib0" in text and "export OMPI_MCA_btl_tcp_if_include=ib0" in text


def test_component_options_gpu_trainer():
    opts = component_options(_layout("gpu_tp4"), "trainer")
    assert opts == ["--partition=gpu", "--nodes=2", "--ntasks=8", "--ntasks-per-node=4", "--cpus-per-task=16",
                    "--gpus-per-node=4", "--mem=400G", "--time=1-00:00:00", "--account=rlgroup", "--qos=high",
                    "--constraint=h100", "--signal=USR2@300", "--exclusive"]
    assert slurm_time(30) == "00:30:00" and slurm_time("1-2") == "1-02:00:00"


def test_render_refuses_invalid_layouts_and_names():
    with pytest.raises(LayoutError, match="rollout_ranks"):
        render_sbatch(JobLayout(rollout_ranks=0), COMMAND, "demo", FOLDER)
    with pytest.raises(LayoutError, match="job_name"):
        render_sbatch(JobLayout(), COMMAND, "my job", FOLDER)


def test_check_partitions():
    layout = _layout("gpu_tp4")
    check_partitions(layout, {"cpu", "gpu", "debug"})
    with pytest.raises(LayoutError, match="unknown partition 'gpu'") as info:
        check_partitions(layout, {"cpu"})
    assert info.value.field == "rollout.partition"


def test_executor_keeps_resources_in_the_layout(monkeypatch):
    executor = _executor(_layout("cpu_small"), monkeypatch)
    assert executor._num_tasks() == 6 and executor.parameters["time"] == 30
    with pytest.raises(ValueError, match="JobLayout"):
        executor.update_parameters(partition="gpu")
    with pytest.raises(ValueError, match="JobLayout"):
        executor.update_parameters(time=5)
    with pytest.raises(ValueError, match="%j"):
        HetJobExecutor("/scratch/%j", _layout("cpu_small"))


SACCT_HET = """JobID|State|NodeList
31+0|COMPLETED|c1
31+0.batch|COMPLETED|c1
31+0.0|COMPLETED|c1
31+1|COMPLETED|c2
31+2|RUNNING|g1
31+3|COMPLETED|g2
32+0|COMPLETED|c1
32+1|FAILED|c2
32+2|CANCELLED by 0|g1
32+3|COMPLETED|g2
33|PENDING|None assigned
"""


def test_sacct_rows_of_het_components_fold_into_the_leader():
    info = HetJobInfoWatcher().read_info(SACCT_HET)
    assert info["31"]["State"] == "RUNNING" and info["31"]["NodeList"] == "c1,c2,g1,g2"
    assert info["32"]["State"] == "FAILED"
    assert info["33"]["State"] == "PENDING" and info["31+2"]["State"] == "RUNNING"
    assert fold_states([{"State": "COMPLETED"}] * 4)["State"] == "COMPLETED"
    assert fold_states([{"State": "REQUEUED"}, {"State": "PENDING"}])["State"] == "REQUEUED"


def test_task_entry_writes_the_rank_log_under_the_leader_id(tmp_path):
    code = ("import os, sys; from marlaas_hpc.launch.hetjob_task import redirect_output; "
            "redirect_output(sys.argv[1]); print('out', flush=True); print('err', file=sys.stderr, flush=True)")
    env = dict(os.environ, SLURM_JOB_ID="77", SLURM_PROCID="5")
    for _ in range(2):
        subprocess.run([os.sys.executable, "-c", code, str(tmp_path)], env=env, check=True)
    assert (tmp_path / "77_5_log.out").read_text() == "out\nout\n"  # appends across requeues
    assert (tmp_path / "77_5_log.err").read_text() == "err\nerr\n"
