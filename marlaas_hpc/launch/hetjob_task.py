"""Per-rank entry of a HetJobExecutor job: `python -m marlaas_hpc.launch.hetjob_task FOLDER`.

Sends this rank's stdout/stderr to submitit's per-task log files (FOLDER/<job id>_<world rank>_log.*),
then runs submitit's own task main (unpickle, run, pickle the result, USR2 checkpoint/requeue).
srun cannot name these files for a het step: its `%t` there is not the world rank and `%j` is the
component's own job id, while SLURM_JOB_ID inside the step is the leader's id for every rank.
`marlaas submit` runs marlaas_hpc.submit instead: the same, then the rank ends through end_rank.
"""
from __future__ import annotations

import os
import sys

from submitit.core.submission import submitit_main
from submitit.core.utils import JobPaths


def redirect_output(folder: str, environ=os.environ) -> JobPaths:
    """Point fds 1 and 2 at this rank's submitit log files (appending, as submitit's --open-mode)."""
    paths = JobPaths(folder, job_id=environ["SLURM_JOB_ID"], task_id=int(environ["SLURM_PROCID"]))
    sys.stdout.flush()
    sys.stderr.flush()
    for fd, path in ((1, paths.stdout), (2, paths.stderr)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(target, fd)
        os.close(target)
    return paths


def main() -> None:
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m marlaas_hpc.launch.hetjob_task SUBMITIT_FOLDER")
    redirect_output(sys.argv[1])
    submitit_main()


if __name__ == "__main__":
    main()
