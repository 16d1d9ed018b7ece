"""The heterogeneous sbatch script of a job layout (template: slurm/hetjob.sbatch.j2).

One `#SBATCH` block per component (control, env, rollout, trainer) separated by `#SBATCH hetjob`,
then one srun step over all of them: a single MPI_COMM_WORLD across all components. The step gives each
component its own part, `--het-group=<i> --cpus-per-task=<n>`, separated by ':' (since Slurm 22.05 srun no
longer takes --cpus-per-task from the allocation: without it every rank got one CPU). The per-component option
lines and the step are shared with the submitit executor (submitit_hetjob.py).

GPUs: rollout ranks ask for theirs per task (--gpus-per-task: each engine its own). A trainer whose TP group
spans several ranks asks for them per node instead (--gpus-per-node with --ntasks-per-node): with
--gpus-per-task, sites that confine devices per task (cgroup ConstrainDevices) show each rank only its own GPU,
and NCCL then sends TP all-reduces through host memory instead of NVLink (NVIDIA/nccl#1066, #324). Per node,
every trainer rank sees the node's GPUs and launch/devices.py gives each its own (node pool). The srun part of
the trainer adds no --gpu-bind=none: the default binding of a --gpus-per-node step is already none, and on Slurm
before 23.11 an explicit --gpu-bind=none leaves CUDA_VISIBLE_DEVICES unset in every task (Slurm bug 16807,
fixed by commit 657efad), which would hide from a rank which GPUs are its job's.
"""
from __future__ import annotations

import math
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from marlaas_hpc.launch.layout import COMPONENTS, JobLayout, LayoutError, parse_slurm_time

TEMPLATE_DIR_ENV = "MARLAAS_SLURM_TEMPLATES"


def template_dir() -> Path:
    """slurm/ of the source tree (or $MARLAAS_SLURM_TEMPLATES)."""
    path = Path(os.environ.get(TEMPLATE_DIR_ENV) or Path(__file__).resolve().parents[2] / "slurm")
    if not (path / "hetjob.sbatch.j2").is_file():
        raise FileNotFoundError(f"no hetjob.sbatch.j2 in {path}; set {TEMPLATE_DIR_ENV} to the project's slurm/ dir")
    return path


def slurm_time(value: str | int) -> str:
    """A time limit as sbatch prints it back (D-HH:MM:SS or HH:MM:SS)."""
    seconds = parse_slurm_time(value)
    days, rest = divmod(seconds, 86400)
    text = f"{rest // 3600:02d}:{rest % 3600 // 60:02d}:{rest % 60:02d}"
    return f"{days}-{text}" if days else text


def time_minutes(value: str | int) -> int:
    return math.ceil(parse_slurm_time(value) / 60)


def gpus_per_node(layout: JobLayout, component: int | str) -> int | None:
    """GPUs per node that a component asks for instead of GPUs per task: the trainer's when its TP group spans
    several ranks (one GPU per rank, the node's ranks sharing them so that NCCL keeps NVLink); else None."""
    name = component if isinstance(component, str) else COMPONENTS[component]
    res = layout.resources(name)
    if name != "trainer" or layout.trainer_tp == 1 or not res.gpus_per_task:
        return None
    return layout.component_sizes[COMPONENTS.index(name)] // res.nodes * res.gpus_per_task


def component_options(layout: JobLayout, component: int | str, *, signal: bool = True) -> list[str]:
    """sbatch options (long form) of one het component, in a fixed order."""
    name = component if isinstance(component, str) else COMPONENTS[component]
    res = layout.resources(name)
    ntasks = layout.component_sizes[COMPONENTS.index(name)]
    per_node = gpus_per_node(layout, name)
    spread = ntasks % res.nodes == 0 and (res.nodes > 1 or per_node)  # GPUs per node need the tasks per node
    opts = [f"--{key}={shlex.quote(str(value))}" for key, value in (
        ("partition", res.partition), ("nodes", res.nodes), ("ntasks", ntasks),
        ("ntasks-per-node", ntasks // res.nodes if spread else None),
        ("cpus-per-task", res.cpus_per_task), ("gpus-per-task", None if per_node else res.gpus_per_task or None),
        ("gpus-per-node", per_node), ("mem", res.mem),
        ("time", slurm_time(layout.component_time(name))), ("account", res.account), ("qos", res.qos),
        ("constraint", res.constraint)) if value is not None]
    if signal:
        opts.append(f"--signal=USR2@{layout.signal_lead_s}")
    return opts + list(res.extra_sbatch)


STEP_OPTIONS = ("--unbuffered", "--kill-on-bad-exit=1")
"""srun options of the whole step (Slurm propagates both to every het component's part)."""


def srun_parts(layout: JobLayout, *extra: str) -> list[list[str]]:
    """One srun part per het component: `--het-group=<i>` with that component's CPUs per task, then `extra` (srun
    options for every part). The step writes them separated by ':' and the command after the last part: srun
    runs it in every part (it reuses the next application given for the parts without one)."""
    return [[f"--het-group={i}", f"--cpus-per-task={layout.resources(name).cpus_per_task}", *extra]
            for i, name in enumerate(COMPONENTS)]


def guarded_srun(layout: JobLayout, python: str, command: str, *extra: str) -> str:
    """The batch script's step: srun running `command` (a shell command line) on every rank, under
    launch/step_guard.py (ends an srun that outlives its step), one het component's part per line.
    `python`: the interpreter as a shell word (already quoted, as submitit keeps it)."""
    guard = shlex.join(["-m", "marlaas_hpc.launch.step_guard", f"--grace={layout.srun_grace_s}", "--", "srun",
                        *STEP_OPTIONS, f"--mpi={layout.mpi}"])
    parts = [shlex.join(part) for part in srun_parts(layout, *extra)]
    return " \\\n    ".join([f"{python} {guard}", *(f"{part} :" for part in parts[:-1]), parts[-1], command])


def ulfm_step(layout: JobLayout, python: str, command: str) -> str:
    """The batch script's step under `layout.mpi: ulfm`: ULFM's mpiexec on the leader node, its daemons started
    through srun in each het component with the CPUs and GPUs each rank of it holds (launch/ulfm_slurm.py), under
    the step guard (its supervisor hears every rank: causes of losses, hangs, rank 0's status for the job's)."""
    resources = [layout.resources(name) for name in COMPONENTS]
    cpus = ",".join(str(res.cpus_per_task) for res in resources)
    gpus = ",".join(str(res.gpus_per_task or 0) for res in resources)
    guard = shlex.join(["-m", "marlaas_hpc.launch.step_guard", f"--grace={layout.srun_grace_s}", "--"])
    return (f"{python} {guard} {python} -m marlaas_hpc.launch.ulfm_slurm launch --cpus {cpus} --gpus {gpus} -- "
            f"{shlex.quote(command)}")


def job_options(layout: JobLayout) -> list[str]:
    """sbatch options of the whole job (on the leader component): under `mpi: ulfm`, `--no-kill` (a failed node
    ends its ranks, not the allocation: the job goes on without them)."""
    return ["--no-kill"] if layout.mpi == "ulfm" else []


def job_step(layout: JobLayout, python: str, command: str, *extra: str) -> str:
    """The batch script's step: srun with the site's MPI plugin (`guarded_srun`), or ULFM's mpiexec (`ulfm_step`:
    srun's extra options do not apply)."""
    if layout.mpi == "ulfm":
        return ulfm_step(layout, python, command)
    return guarded_srun(layout, python, command, *extra)


def render_sbatch(layout: JobLayout, command: str, job_name: str, folder: str | Path,
                  requeue_marker: str | Path | None = None, python: str = sys.executable) -> str:
    """The sbatch script running `command` (a shell command line) on every rank of `layout`.
    Slurm writes the batch log to FOLDER/<job_name>-<jobid>.out (the folder must exist at submission).
    `requeue_marker`: a file the command leaves when it checkpointed on USR2; the script then requeues.
    `python`: the interpreter (with marlaas_hpc importable) that runs the step guard on the leader node."""
    import jinja2

    layout.validate()
    if not job_name or any(c.isspace() for c in job_name):
        raise LayoutError("job_name", f"must be a non-empty word, got {job_name!r}")
    folder = Path(folder)
    blocks = []
    for i, name in enumerate(COMPONENTS):
        opts = component_options(layout, name)
        if i == 0:  # job-wide options live on the leader
            log = shlex.quote(str(folder / "%x-%j.out"))
            opts = [f"--job-name={shlex.quote(job_name)}", f"--output={log}", "--requeue"] + opts + job_options(layout)
        blocks.append({"name": name, "ntasks": layout.component_sizes[i], "options": opts})
    env = Path(template_dir())
    tmpl = jinja2.Environment(loader=jinja2.FileSystemLoader(str(env)), undefined=jinja2.StrictUndefined,
                              keep_trailing_newline=True, trim_blocks=True, lstrip_blocks=True)
    return tmpl.get_template("hetjob.sbatch.j2").render(
        job_name=job_name, world_size=layout.world_size, trainer_tp=layout.trainer_tp,
        trainer_dp=layout.trainer_dp, trainer_groups=layout.trainer_groups, blocks=blocks, setup=layout.setup,
        exports=[f"export {k}={shlex.quote(v)}" for k, v in layout.exports_for_job().items()],
        step=job_step(layout, shlex.quote(python), command), grace_s=layout.srun_grace_s, ulfm=layout.mpi == "ulfm",
        requeue_marker=shlex.quote(str(requeue_marker)) if requeue_marker else "")


def cluster_partitions() -> set[str] | None:
    """Partitions the cluster has (sinfo), or None when sinfo is absent or fails."""
    if shutil.which("sinfo") is None:
        return None
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%R"], capture_output=True, text=True, timeout=20, check=True)
    except (subprocess.SubprocessError, OSError):
        return None
    return {line.strip() for line in out.stdout.splitlines() if line.strip()}


def check_partitions(layout: JobLayout, available: set[str] | None = None) -> None:
    """Refuses partitions the cluster does not have (asks sinfo when `available` is None; no-op without it)."""
    available = cluster_partitions() if available is None else available
    if available is None:
        return
    for name in COMPONENTS:
        partition = layout.resources(name).partition
        if partition is not None and partition not in available:
            raise LayoutError(f"{name}.partition", f"unknown partition {partition!r}; the cluster has "
                                                   f"{sorted(available)}")
