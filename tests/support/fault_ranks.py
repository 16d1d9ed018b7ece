"""A small MPI program for the supervisor tests (test_launch_supervise.py): three ranks that report to the
job's monitor like marlaas ranks do, then one of them fails in the way asked for.

    mpirun -np 3 python tests/support/fault_ranks.py WHAT RUN_DIR
    WHAT: ok | kill (rank 2 SIGKILLs itself while rank 1 waits on it in a gloo broadcast) | raise (rank 1 raises
          an OSError ENOSPC) | hang (rank 2 SIGKILLs itself, no MPI: run as plain processes by a launcher that
          never stops them) | stuck (every rank beats; rank 2's loop stops turning inside a 'generate' span, as
          a deadlocked engine's would: its hang_timeout_s is 2 s) | kill0 (under the ULFM mpiexec: rank 0 SIGKILLs
          itself, the others end as if the job went on; that mpiexec then exits 0)
"""
import errno
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

from marlaas_hpc.launch.monitor import RankReporter
from marlaas_hpc.runtime.process import report_crash

ROLES = ["scheduler", "env", "rollout"]


def gloo_pair(comm, rank):
    """Ranks 1 and 2 share a gloo group, as the trainer leader and a rollout rank share the delta broadcast."""
    import torch.distributed as dist

    from marlaas_hpc.runtime.delta.groups import host_store, join_store

    store, address = host_store(2, "127.0.0.1", 60) if rank == 1 else (None, None)
    address = comm.bcast(address, root=1)
    if rank == 0:
        return None
    store = store or join_store(address, 2, 60)
    return dist.ProcessGroupGloo(store, rank - 1, 2, timedelta(seconds=60))


def main(what: str, run_dir: str) -> None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    reporter = RankReporter.connect({"rank": rank, "role": ROLES[rank], "run_dir": run_dir, "max_crash_requeues": 1,
                                     "hang_timeout_s": 2.0 if what == "stuck" else 0})
    group = gloo_pair(comm, rank) if what == "kill" else None
    comm.Barrier()
    if what == "stuck":
        stuck(reporter, rank)
    if what == "kill0":
        kill0(reporter, rank)
    try:
        if what == "kill" and rank == 2:
            time.sleep(0.5)
            os.kill(os.getpid(), signal.SIGKILL)
        if what == "kill" and rank == 1:
            import torch

            group.broadcast(torch.zeros(4), 0).wait()  # rank 2 never joins: gloo says "Connection closed by peer"
        if what == "raise" and rank == 1:
            raise OSError(errno.ENOSPC, "No space left on device", f"{run_dir}/tasks/alice/add/adapters/v0003")
        if what != "ok":
            time.sleep(120)  # the launcher takes this rank down
    except Exception as exc:
        report_crash(exc, Path(run_dir), rank, reporter)
        comm.Abort(1)
    comm.Barrier()
    reporter.bye(0 if rank == 0 else None)  # rank 0 says the job's status, as runtime/main.py does


def kill0(reporter, rank: int) -> None:
    """Rank 0 dies outright; the others outlive it and end without MPI_Finalize (its agreement would wait for the
    dead rank), as the ranks of a ULFM job whose daemons were taken down do."""
    if rank == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(2.0)
    reporter.bye()
    os._exit(0)


def stuck(reporter, rank: int) -> None:
    """Every rank's loop turns and beats; rank 2's stops turning in the middle of a span (the supervisor kills it,
    then the launcher the others)."""
    reporter.start_heartbeat()
    deadline = time.monotonic() + 120
    if rank == 2:
        reporter.doing("generate", ["add"])
    while time.monotonic() < deadline:
        if rank != 2:
            reporter.turned()
        time.sleep(0.05)


def hang(run_dir: str) -> None:
    """A 'launcher' that starts three plain processes and waits for all of them, never stopping the others when
    one dies (as srun without --kill-on-bad-exit would)."""
    import subprocess

    from marlaas_hpc.launch.supervise import die_with_parent

    procs = [subprocess.Popen([sys.executable, __file__, "hang-rank", run_dir, str(rank)], preexec_fn=die_with_parent)
             for rank in range(3)]
    for proc in procs:
        proc.wait()


def hang_rank(run_dir: str, rank: int) -> None:
    reporter = RankReporter.connect({"rank": rank, "role": ROLES[rank], "run_dir": run_dir})
    time.sleep(1.0)
    if rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(300)
    reporter.bye()


if __name__ == "__main__":
    if sys.argv[1] == "hang":
        hang(sys.argv[2])
    elif sys.argv[1] == "hang-rank":
        hang_rank(sys.argv[2], int(sys.argv[3]))
    else:
        main(sys.argv[1], sys.argv[2])
