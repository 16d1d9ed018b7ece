"""Per-rank entry of a HetJobExecutor job: `python -m marlaas_hpc.launch.hetjob_task FOLDER`.

Sends this rank's stdout/stderr to submitit's per-task log files (FOLDER/<job id>_<world rank>_log.*),
then runs submitit's own task main (unpickle, run, pickle the result, USR2 checkpoint/requeue).
srun cannot name these files for a het step: its `%t` there is not the world rank and `%j` is the
component's own job id, while SLURM_JOB_ID inside the step is the leader's id for every rank.
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


def exit_watchdog(code: int, grace_s: float = 120.0) -> None:
    """Ends this process `grace_s` after its work is done if interpreter shutdown (MPI_Finalize, thread
    joins) has not: once on the emulated test cluster every rank of a finished job (results and summary
    written) hung at exit until the time limit, holding the allocation. A daemon timer still runs while
    the main thread waits in shutdown."""
    import threading

    def _exit() -> None:
        print(f"marlaas: process still alive {grace_s:.0f} s after its job ended (hung in shutdown); "
              f"exiting with status {code}", file=sys.stderr, flush=True)
        os._exit(code)

    timer = threading.Timer(grace_s, _exit)
    timer.daemon = True
    timer.start()


def main() -> None:
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m marlaas_hpc.launch.hetjob_task SUBMITIT_FOLDER")
    redirect_output(sys.argv[1])
    code = 0
    try:
        submitit_main()
    except SystemExit as exc:  # submitit's requeue path exits -1 on purpose
        code = exc.code if isinstance(exc.code, int) else 1
        raise
    except BaseException:
        code = 1
        raise
    finally:
        exit_watchdog(code & 0xFF)


if __name__ == "__main__":
    main()
