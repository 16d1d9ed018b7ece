"""The heterogeneous sbatch script of a job layout (template: slurm/hetjob.sbatch.j2).

One `#SBATCH` block per component (control, env, rollout, trainer) separated by `#SBATCH hetjob`,
then one `srun --het-group=0-3 --mpi=<plugin>` step: a single MPI_COMM_WORLD across all components.
The per-component option lines are shared with the submitit executor (submitit_hetjob.py).
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


def component_options(layout: JobLayout, component: int | str, *, signal: bool = True) -> list[str]:
    """sbatch options (long form) of one het component, in a fixed order."""
    name = component if isinstance(component, str) else COMPONENTS[component]
    res = layout.resources(name)
    ntasks = layout.component_sizes[COMPONENTS.index(name)]
    opts = [f"--{key}={shlex.quote(str(value))}" for key, value in (
        ("partition", res.partition), ("nodes", res.nodes), ("ntasks", ntasks),
        ("ntasks-per-node", ntasks // res.nodes if ntasks % res.nodes == 0 and res.nodes > 1 else None),
        ("cpus-per-task", res.cpus_per_task), ("gpus-per-task", res.gpus_per_task or None), ("mem", res.mem),
        ("time", slurm_time(layout.component_time(name))), ("account", res.account), ("qos", res.qos),
        ("constraint", res.constraint)) if value is not None]
    if signal:
        opts.append(f"--signal=USR2@{layout.signal_lead_s}")
    return opts + list(res.extra_sbatch)


def srun_args(layout: JobLayout) -> list[str]:
    """Arguments of the one srun step that starts every rank."""
    return [f"--het-group=0-{len(COMPONENTS) - 1}", f"--mpi={layout.mpi}", "--kill-on-bad-exit=1"]


def guarded_srun(layout: JobLayout, python: str, *extra: str) -> str:
    """The batch script's srun line, run under launch/step_guard.py (ends an srun that outlives its step).
    `python`: the interpreter as a shell word (already quoted, as submitit keeps it)."""
    return f"{python} " + shlex.join(["-m", "marlaas_hpc.launch.step_guard", f"--grace={layout.srun_grace_s}",
                                      "--", "srun", "--unbuffered", *srun_args(layout), *extra])


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
            opts = [f"--job-name={shlex.quote(job_name)}", f"--output={log}", "--requeue"] + opts
        blocks.append({"name": name, "ntasks": layout.component_sizes[i], "options": opts})
    env = Path(template_dir())
    tmpl = jinja2.Environment(loader=jinja2.FileSystemLoader(str(env)), undefined=jinja2.StrictUndefined,
                              keep_trailing_newline=True, trim_blocks=True, lstrip_blocks=True)
    return tmpl.get_template("hetjob.sbatch.j2").render(
        job_name=job_name, world_size=layout.world_size, trainer_tp=layout.trainer_tp,
        trainer_dp=layout.trainer_dp, trainer_groups=layout.trainer_groups, blocks=blocks, setup=layout.setup,
        exports=[f"export {k}={shlex.quote(v)}" for k, v in layout.exports_for_job().items()],
        srun=guarded_srun(layout, shlex.quote(python)), grace_s=layout.srun_grace_s, command=command,
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
