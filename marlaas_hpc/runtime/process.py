"""A rank's process from start to end: the job it runs, its device bound before MPI_Init, the checks every rank
makes together before any role starts, its crash report, and how it ends (MPI finalized with a deadline under
ULFM, or killed at once when lost in a tolerant job).

    runtime/main.py      the entry point: arguments, then these steps in order
    runtime/process.py   load_job -> bind_rank_device -> MPI_Init -> start checks (refuse_start) -> live_comm
                         -> [runtime/roles.py run_rank] -> end_barrier -> end_rank
    runtime/join.py      a rank started into the live job (marlaas scale, layout.rollout_replace)

Each rank's device comes from launch/devices.py (bind_device) and is applied before MPI_Init, which may start CUDA
(bind_rank_device). A rank that dies of an exception reports it to the job's supervisor (launch/monitor.py: one
message names the rank, its role and the cause) and keeps its traceback in RUN_DIR/crash/rank<N>.txt
(report_crash).
"""
from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from marlaas_hpc.config import JobConfig
from marlaas_hpc.launch.layout import ranks_of
from marlaas_hpc.runtime.comm import quiet_barrier
from marlaas_hpc.tasks.spec import SpecError

if TYPE_CHECKING:
    from marlaas_hpc.launch.devices import DeviceBinding


def roles_of(layout) -> dict[str, list[int]]:
    return {kind: list(ranks_of(kind, layout)) for kind in ("env", "rollout", "trainer")}


PREEMPTED_EXIT = 75
"""Exit status of a job that stopped at a checkpoint (EX_TEMPFAIL: run it again with --resume)."""
JOB_FILE = "job.yaml"
"""The config a run dir was started with (overrides applied): what `--resume DIR` runs again."""


def load_job(config_path: str | None, run_dir: str | None, mode: str | None, resume: bool = False) -> JobConfig:
    """The job of a fresh start (CONFIG, with --run-dir/--mode overrides) or of a resume (RUN_DIR/job.yaml
    unless a CONFIG is given)."""
    if config_path is None:
        if not (resume and run_dir):
            raise SpecError("config", "a config file is required (or --resume RUN_DIR)")
        config_path = str(Path(run_dir) / JOB_FILE)
        if not Path(config_path).is_file():
            raise SpecError("resume", f"{run_dir} has no {JOB_FILE}: not a run dir of this tool")
    job = JobConfig.load(config_path)
    if run_dir:
        job.run_dir = run_dir
    if mode:
        job.mode = mode
    return job.validate()


def check_run_dir(job: JobConfig, resume: bool) -> dict | None:
    """A fresh start refuses a run dir holding the checkpoint of an unfinished job (it would mix two jobs'
    outputs); a resume needs one. Returns the checkpoint to resume from."""
    from marlaas_hpc.runtime.checkpoint import checkpoint_file, load_job_checkpoint

    try:
        state = load_job_checkpoint(Path(job.run_dir), warn=lambda message: print(f"marlaas: {message}",
                                                                                 file=sys.stderr))
    except ValueError as exc:
        raise SpecError("resume" if resume else "run_dir", str(exc)) from None
    if resume and state is None:
        raise SpecError("resume", f"{checkpoint_file(job.run_dir)} not found, or its job finished: nothing to "
                                  "resume")
    if not resume and state is not None:
        raise SpecError("run_dir", f"{job.run_dir} holds a checkpoint of an earlier job: resume it with "
                                   f"`marlaas run --resume {job.run_dir}` or choose another run dir")
    return state


def save_job_file(job: JobConfig, config_path: str) -> None:
    import yaml

    data = yaml.safe_load(Path(config_path).read_text()) or {}
    data.update(run_dir=str(Path(job.run_dir).resolve()), mode=job.mode)
    path = Path(job.run_dir) / JOB_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.resolve() != Path(config_path).resolve():
        path.write_text(yaml.safe_dump(data, sort_keys=False))


@dataclass(frozen=True)
class EarlyBinding:
    """What `bind_rank_device` decided before MPI_Init, kept for the check against MPI's placement after it."""

    binding: "DeviceBinding | None"
    """The binding applied, None when refused."""
    refusal: str | None
    """Why the rank cannot get its device (reported by rank 0 once MPI is up)."""
    environ: dict[str, str]
    """The launcher's environment as it was before CUDA_VISIBLE_DEVICES was narrowed."""
    driver_gpus: int
    """GPUs the driver lists on the node."""


def bind_rank_device(job: JobConfig, environ=os.environ) -> EarlyBinding:
    """This rank's device (launch/devices.py), applied BEFORE MPI_Init: a CUDA-aware MPI transport (UCX) may start
    CUDA inside MPI_Init, and CUDA reads CUDA_VISIBLE_DEVICES once, when it starts. MPI is not up yet, so the rank
    and the ranks sharing its node come from the launcher's variables; `check_rank_device` compares them with MPI's
    placement once it is. A refusal is kept, not raised: every rank must reach MPI_Init for rank 0 to report it."""
    from marlaas_hpc.launch.devices import (apply_binding, bind_device, count_driver_gpus, node_ranks_from_env,
                                            world_rank_from_env)

    launcher_env, driver_gpus = dict(environ), count_driver_gpus()
    try:
        binding = bind_device(launcher_env, world_rank_from_env(launcher_env), job.layout, driver_gpus=driver_gpus,
                              node_ranks=node_ranks_from_env(launcher_env))
        apply_binding(binding, environ)
    except (SpecError, RuntimeError, ValueError) as exc:
        return EarlyBinding(None, str(exc), launcher_env, driver_gpus)
    return EarlyBinding(binding, None, launcher_env, driver_gpus)


def node_gpus(early: EarlyBinding) -> tuple[str, ...]:
    """The GPUs of this rank's node as the launcher gave them (before this rank's own were narrowed): what rank 0
    gives joiners from in local mode (runtime/scaling.py)."""
    from marlaas_hpc.launch.devices import DeviceError, visible_gpus

    try:
        return visible_gpus(early.environ, early.driver_gpus)[0]
    except DeviceError:
        return ()


def check_rank_device(comm, job: JobConfig, early: EarlyBinding) -> str | None:
    """After MPI_Init (collective): the refusal of `bind_rank_device`, or a binding that MPI's placement (world
    rank, and the ranks sharing the node from a shared-memory split, whatever the launcher) would change; None
    when the rank runs on the device it was bound to."""
    from mpi4py import MPI

    from marlaas_hpc.launch.devices import placement_mismatch

    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    node_ranks = node.allgather(comm.Get_rank())
    node.Free()
    if early.refusal is not None:
        return early.refusal
    return placement_mismatch(early.environ, job.layout, early.driver_gpus, early.binding, comm.Get_rank(),
                              node_ranks)


def start_checks(comm, job: JobConfig, config_path: str | None, resume: bool,
                 early: EarlyBinding) -> tuple[list[str], dict | None]:
    """Collective over the world, right after MPI_Init: the world's size against the layout, the run dir and the
    model (rank 0 checks, the others wait), then every rank's device. Returns why the job must not start (every
    rank gets the same list; empty: it starts) and, on rank 0, the checkpoint a resume continues from."""
    from marlaas_hpc.launch.layout import world_size_matches
    from marlaas_hpc.runtime.checkpoint import requeue_marker

    check = world_size_matches(job.layout, comm.Get_size())
    if not check:
        return [check.message], None
    state, ok = None, None
    if comm.Get_rank() == 0:
        try:
            job.model_paths()  # a missing checkpoint stops every rank here, naming `model` (or `models.<name>`)
            state = check_run_dir(job, resume)
            if not resume:
                save_job_file(job, config_path)
            requeue_marker(Path(job.run_dir)).unlink(missing_ok=True)
            ok = ""
        except SpecError as exc:
            ok = str(exc)
    quiet_barrier(comm)  # the other ranks wait here while rank 0 checks the run dir and the model
    ok = comm.bcast(ok, root=0)
    if ok:
        return [ok], None
    refusals = comm.allgather(check_rank_device(comm, job, early))
    return list(dict.fromkeys(r for r in refusals if r)), state


def log_devices(bindings, log) -> None:
    """Rank 0: every GPU rank's binding, or one line when the whole job runs on the CPU."""
    if bindings is None:
        return
    gpu_roles = [b for b in bindings if b.role in ("rollout", "trainer")]
    if not any(b.is_cuda for b in gpu_roles):
        log(f"[device] every rank on the CPU ({gpu_roles[0].how})")
        return
    for binding in gpu_roles:
        log(f"[device] {binding.describe()}")


def describe_role(role, trainer_groups: int = 1) -> str:
    """A rank's role as the crash message names it."""
    if role.kind != "trainer":
        return role.kind
    group = f" of trainer group {role.group}" if trainer_groups > 1 else ""
    if role.tp_rank == 0:
        return f"trainer leader{group}" if role.dp_rank == 0 else f"trainer leader{group}, DP rank {role.dp_rank}"
    return f"trainer follower{group}, TP rank {role.tp_rank}"


def record_rank(run_dir: Path, rank: int, role: str, **extra) -> None:
    """RUN_DIR/ranks/rank<N>.json: pid and host of each rank of the current run (operators and the fault tests
    find a rank's process here), and `extra` (a joined rank's slot and GPUs under Slurm)."""
    import json

    from marlaas_hpc.rundir import atomic_write_text

    atomic_write_text(Path(run_dir) / "ranks" / f"rank{rank}.json", json.dumps(
        {"rank": rank, "role": role, "pid": os.getpid(), "host": socket.gethostname(), **extra}) + "\n")


def report_crash(exc: BaseException, run_dir: Path, rank: int, reporter) -> None:
    """Keeps the traceback in RUN_DIR/crash/rank<N>.txt and tells the supervisor; without one (a plain
    mpirun), prints the traceback as before."""
    import traceback

    from marlaas_hpc.runtime.faults import describe, is_peer_lost

    text = "".join(traceback.format_exception(exc))
    path = Path(run_dir) / "crash" / f"rank{rank}.txt"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    except OSError:  # the disk may be what failed
        path = None
    if reporter.connected:
        reporter.crash(describe(exc), is_peer_lost(exc), str(path) if path else None)
    else:
        sys.stderr.write(text)
        sys.stderr.flush()


def refuse_start(comm, messages: list[str]) -> int:
    """Every rank refuses to start (a bad config or run dir, a device the layout cannot have): rank 0 says why, and
    the job ends with status 2. Under the ULFM launcher the status goes through the supervisor (rank 0's bye) and
    every rank exits 0: ULFM's mpiexec sometimes never exited when all of its ranks ended non-zero (a refused
    start hung the job until the test's 300 s timeout, about 1 run in 3)."""
    from marlaas_hpc.launch.monitor import RankReporter
    from marlaas_hpc.launch.mpi import ft_enabled

    if comm.Get_rank() == 0:
        for message in messages:
            print(f"marlaas: {message}", file=sys.stderr, flush=True)
    if not ft_enabled():
        return 2
    reporter = RankReporter.connect({"rank": comm.Get_rank(), "role": "refused"})
    if not reporter.connected:
        return 2  # no supervisor to hear the status: the exit status says it
    reporter.bye(2 if comm.Get_rank() == 0 else None)
    return 0


def live_comm(comm, job: JobConfig):
    """COMM_WORLD as the roles use it (runtime/membership.py): tolerant of a worker's loss when the job asks for it
    (fault.on_rank_loss: continue) and its MPI can (launch/mpi.py)."""
    from mpi4py import MPI

    from marlaas_hpc.launch.mpi import fault_tolerance_missing
    from marlaas_hpc.runtime.membership import LiveComm, Membership

    wanted = job.fault.on_rank_loss == "continue"
    why_not = fault_tolerance_missing(MPI.Get_library_version()) if wanted else None
    return LiveComm(comm, Membership(roles_of(job.layout), tolerant=wanted and why_not is None, why_not=why_not))


END_BARRIER_S = 30.0
"""A tolerant job's last barrier gives up after this long (a rank lost after rank 0's Shutdown may hold it)."""


def end_barrier(live) -> None:
    """Ranks leave their loops at different times: the early ones wait without spinning. After a loss there is
    none: a collective among the survivors needs COMM_WORLD shrunk to them, and MPIX_Comm_shrink at the end of a
    job that lost a trainer group hung on every survivor here (its agreement never completed); every rank has
    written its outputs by now, and MPI_Finalize has its deadline (end_rank)."""
    if not live.members.tolerant:
        quiet_barrier(live.world)
        return
    if live.members.ended_lost:  # every survivor takes this branch: rank 0's Shutdown listed the same ranks
        return
    try:
        quiet_barrier(live.world, timeout_s=END_BARRIER_S)
    except Exception as exc:  # a rank lost at the very end: nothing is left to wait for
        if not live.note_failure(exc):
            raise


def end_lost_rank() -> None:
    """A worker that failed in a tolerant job ends at once, without MPI_Finalize (a collective the others reach only
    at the end of the job), and by SIGKILL, not exit(): the runtime reports a killed process failed to its peers
    (0.4 s here), but a process that exits without MPI_Finalize it never reported, and every survivor then waited
    for it in MPI_Finalize for ever (measured with the ULFM Open MPI 5.0.11)."""
    import signal

    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def end_rank(code: int) -> None:
    """Ends this rank's process once every output is written: MPI finalized, stdio flushed, then os._exit. The
    interpreter's own teardown of torch, vLLM and megatron took ~1.3 s per rank (and a rollout rank's orderly
    vLLM shutdown ~0.9 s more), all of it time the job's launcher waited for and none of it freeing anything
    that the exit does not. (Env ranks close their pools and sandbox workers themselves before they get here.)
    A rank that stopped before MPI_Init (a config it could not read) ends without starting MPI."""
    sys.stdout.flush()
    sys.stderr.flush()
    if "mpi4py.MPI" in sys.modules:  # imported = initialized (mpi4py's default)
        from mpi4py import MPI

        from marlaas_hpc.launch.mpi import ft_enabled

        if MPI.Is_initialized() and not MPI.Is_finalized():
            if ft_enabled():
                _finalize_deadline()
            MPI.Finalize()
    os._exit(code)


FINALIZE_DEADLINE_S = 30
"""Under ULFM, how long MPI_Finalize may take before the rank ends without it."""


def _finalize_deadline() -> None:
    """Under ULFM, MPI_Finalize runs an agreement among the survivors, which never ends if a peer left without
    being reported failed (end_lost_rank says how that happened), and spins (100% CPU) until a late survivor comes:
    one that waited at its end on a retired delta channel's gloo threads did so after every lost or joined rollout
    rank, until runtime/delta/groups.py `keep_till_exit` (2026-11-29); its PMIx fence, which after a loss did not end
    in about half the jobs, is skipped (launch/mpi.py `ASYNC_FINALIZE`). Everything is written and said by now, so
    after FINALIZE_DEADLINE_S the kernel ends the rank (SIGALRM's default action: no Python thread can run while
    MPI_Finalize holds the GIL); its peers see it fail, and mpiexec still exits 0 (a lost rank does not change its
    status under ULFM)."""
    import signal

    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    signal.alarm(FINALIZE_DEADLINE_S)
