"""submitit for heterogeneous jobs: one executor subclass, the rest stays submitit's.

submitit 1.5.x has no hetjob support (facebookincubator/submitit#1741). This executor keeps submitit's
pickled submission, `Job` handles (state via sacct, results and exceptions per rank) and the
Checkpointable USR2 requeue, and changes only what a het job needs:

- component 0 (control) is submitit's own option block; components 1..3 follow as `#SBATCH hetjob` +
  `#SBATCH` lines emitted through submitit's `setup` lines, which still sit inside the option header
  (`additional_parameters` are sorted, so separators cannot go there);
- the step is one srun with a part per component (`--het-group=<i> --cpus-per-task=<n>`, launch/sbatch.py) and
  every rank runs `marlaas_hpc.launch.hetjob_task` (or the executor's `task_module`),
  which writes its log to FOLDER/<leader id>_<world rank>_log.{out,err} itself: srun's `%t` in a het step
  is not the world rank (Slurm 22.05 gives component c's ranks r+c) and `%j` is each component's own id;
- `_num_tasks()` is the world size, so `job.results()` returns every rank's result;
- sacct lists a het job as `<id>+0 … <id>+3`: the job class folds those rows into the leader's state.

Do not put `%j` in the folder: every component would expand it to its own id.
"""
from __future__ import annotations

import shlex
import typing as tp
from pathlib import Path

from submitit.core import utils
from submitit.slurm import slurm as _slurm

from marlaas_hpc.launch.layout import COMPONENTS, JobLayout
from marlaas_hpc.launch.sbatch import component_options, job_options, job_step, time_minutes

# options the layout owns; setting them through update_parameters would desynchronise the components
_LAYOUT_OWNED = {"partition", "nodes", "ntasks_per_node", "cpus_per_task", "cpus_per_gpu", "num_gpus",
                 "gpus_per_node", "gpus_per_task", "mem", "mem_per_gpu", "mem_per_cpu", "time", "qos",
                 "constraint", "account", "gres", "signal_delay_s", "use_srun", "nodelist", "exclude"}

# state precedence when folding het components into one job state (first match wins)
_ACTIVE = ("RUNNING", "COMPLETING", "REQUEUED", "PENDING", "READY", "PREEMPTED", "SUSPENDED")


class HetJobInfoWatcher(_slurm.SlurmInfoWatcher):
    """SlurmInfoWatcher that also reports a het job under its leader id (sacct rows `<id>+<i>`)."""

    def read_info(self, string: tp.Union[bytes, str]) -> tp.Dict[str, tp.Dict[str, str]]:
        info = super().read_info(string)
        components: tp.Dict[str, tp.List[tp.Dict[str, str]]] = {}
        for key, stats in info.items():
            leader, plus, index = key.partition("+")
            if plus and index.isdigit():
                components.setdefault(leader, []).append(stats)
        for leader, rows in components.items():
            info[leader] = fold_states(rows)
        return info


def fold_states(rows: tp.Sequence[tp.Dict[str, str]]) -> tp.Dict[str, str]:
    """One job state from the per-component sacct rows: any component still active keeps the job
    active; else the first component that did not complete names the outcome; else COMPLETED."""
    states = [row.get("State", "").split(" ")[0] for row in rows]  # e.g. "CANCELLED by 0"
    folded = next((s for s in _ACTIVE if s in states), None)
    folded = folded or next((s for s in states if s != "COMPLETED"), "COMPLETED")
    nodes = ",".join(row.get("NodeList", "") for row in rows if row.get("NodeList"))
    return {"JobID": rows[0].get("JobID", "").partition("+")[0], "State": folded, "NodeList": nodes}


class HetSlurmJob(_slurm.SlurmJob[tp.Any]):
    """A submitit SlurmJob whose state understands het jobs."""

    watcher = HetJobInfoWatcher(delay_s=600)


class HetJobExecutor(_slurm.SlurmExecutor):
    """submitit executor submitting one heterogeneous job per `submit()`, laid out by a JobLayout.

    Every world rank runs the submitted function (pickled once); world rank 0 is the control rank and
    is the one submitit's USR2 handler checkpoints and requeues from. Results: `job.results()` (all ranks)
    or `job.result()` (rank 0). Job arrays (`map_array`) are not supported.
    """

    job_class = HetSlurmJob

    def __init__(self, folder: tp.Union[str, Path], layout: JobLayout, max_num_timeout: int = 3,
                 python: tp.Optional[str] = None, task_module: str = "marlaas_hpc.launch.hetjob_task") -> None:
        if "%j" in str(folder):
            raise ValueError(f"folder {folder!r} contains %j: each het component would expand it to its own job "
                             "id (missing log dirs, MPI_Init hangs); use a fixed folder")
        super().__init__(folder, max_num_timeout=max_num_timeout, python=python)
        self.layout = layout.validate()
        self.task_module = task_module
        """What every rank runs, `python -u -m TASK_MODULE FOLDER`: launch/hetjob_task.py, or an entry that does
        the same and then ends the process its own way (marlaas_hpc.submit)."""
        # submitit's timeout bookkeeping (has_timed_out, countdown) reads parameters["time"] in minutes
        self.parameters["time"] = time_minutes(layout.component_time(0))

    def _internal_update_parameters(self, **kwargs: tp.Any) -> None:
        owned = sorted(set(kwargs) & _LAYOUT_OWNED)
        if owned:
            raise ValueError(f"{owned} come from the JobLayout (per component); set them there")
        super()._internal_update_parameters(**kwargs)

    def _internal_process_submissions(self, delayed_submissions: tp.List[utils.DelayedSubmission]):
        if len(delayed_submissions) > 1:
            raise NotImplementedError("HetJobExecutor submits one het job at a time (no job arrays)")
        return super()._internal_process_submissions(delayed_submissions)

    def _num_tasks(self) -> int:
        return self.layout.world_size

    @property
    def _submitit_command_str(self) -> str:
        return " ".join([self.python, "-u -m", self.task_module, shlex.quote(str(self.folder))])

    def _make_submission_file_text(self, command: str, uid: str) -> str:
        params = dict(self.parameters)
        leader = self.layout.resources(0)
        params.update(nodes=leader.nodes, signal_delay_s=self.layout.signal_lead_s, use_srun=False,
                      partition=leader.partition, account=leader.account, qos=leader.qos,
                      constraint=leader.constraint, cpus_per_task=leader.cpus_per_task)
        extra = dict(params.get("additional_parameters") or {})
        extra.update(ntasks=self.layout.component_sizes[0], requeue=True)
        if leader.mem is not None:
            extra["mem"] = leader.mem
        extra.update(_options_as_parameters(leader.extra_sbatch))
        extra.update(_options_as_parameters(job_options(self.layout)))
        params["additional_parameters"] = extra
        params["setup"] = (self._header_lines() + self.layout.setup + list(params.get("setup") or [])
                           + [f"export {k}={shlex.quote(v)}" for k, v in self.layout.exports_for_job().items()])
        step = job_step(self.layout, self.python, command, *(params.pop("srun_args", None) or []))
        return _slurm._make_sbatch_string(command=step, folder=self.folder, **params)

    def _header_lines(self) -> tp.List[str]:
        """`#SBATCH hetjob` + option lines of components 1..3 (they must precede every shell command)."""
        lines: tp.List[str] = []
        for i, name in enumerate(COMPONENTS[1:], start=1):
            lines += ["#SBATCH hetjob", f"# het group {i}: {name} ({self.layout.component_sizes[i]} ranks)"]
            lines += [f"#SBATCH {opt}" for opt in component_options(self.layout, i)]
        return lines + ["set -euo pipefail"]


def _options_as_parameters(options: tp.Sequence[str]) -> tp.Dict[str, tp.Any]:
    """'--key=value' / '--flag' strings as submitit additional_parameters (rendered back as the same lines)."""
    out: tp.Dict[str, tp.Any] = {}
    for option in options:
        key, eq, value = option[2:].partition("=")
        out[key.replace("-", "_")] = value if eq else True
    return out
