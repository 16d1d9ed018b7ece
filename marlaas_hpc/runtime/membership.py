"""Rank membership: who is in the job (alive, lost, joined), and the communicator every role talks through.

    world ranks     0 scheduler | env ranks | rollout ranks | trainer ranks        MPI COMM_WORLD, fixed at start

One `Membership` per rank, made by runtime/main.py beside the communicators and handed to the role's loop with
its `LiveComm`; it is the one place that knows which peers are alive. Roles keep addressing peers by world rank.

Under ULFM (`tolerant`: the job's `fault.on_rank_loss` is 'continue' and its MPI survives a peer's death,
launch/mpi.py), `LiveComm` turns a peer's death into membership instead of an error:
- a probe that finds a failed peer (MPI_ERR_PROC_FAILED, or _PENDING on a receive from anyone) acknowledges the
  failures (`MPIX_Comm_ack_failed`: receives from anyone work again), records the dead ranks here, and goes on;
- a send to a lost rank is dropped, and a pending one that fails with it (the Outbox's `test_send`) too;
- waiting on one rank that is lost (a trainer leader on its follower's acknowledgement, a follower on its
  leader) raises `RankLostError`: the caller's own group is gone, and it is the caller's to decide what then.
Nothing is revoked or shrunk while the job runs (shrinking renumbers ranks, and every role addresses peers by
world rank): point-to-point traffic between survivors keeps working on COMM_WORLD (and the end of a job that lost a rank has
no last barrier: runtime/main.py `_end_barrier`).

Without ULFM nothing changes: every MPI error propagates, the rank dies, and the job stops and resumes.

Rank 0 alone decides what a loss means (runtime/scheduler_rank.py): `take_lost()` hands it each rank its own
probes found lost, once; it tells the scheduler (RankLost), then every live worker (RankLost on TAG_CMD), whose
Membership records it (`mark_lost`): a worker may learn of a loss from rank 0 before its own MPI tells it.
"""
from __future__ import annotations

import time

from marlaas_hpc.runtime.faults import RankLostError


class Membership:
    """Who is alive: every rank's role kind, the ranks lost (and when this rank learned it)."""

    def __init__(self, roles: dict[str, list[int]], tolerant: bool = False, why_not: str | None = None):
        self.kind_of: dict[int, str] = {0: "scheduler"}
        for kind, ranks in roles.items():
            for rank in ranks:
                self.kind_of[rank] = kind
        self.tolerant = tolerant
        """A worker's loss leaves the job going (ULFM and fault.on_rank_loss: continue)."""
        self.why_not = why_not
        """Why not, when fault.on_rank_loss asks for it but the MPI cannot (the supervisor's message says it)."""
        self.lost: dict[int, float] = {}
        """Rank -> when this rank learned it was lost."""
        self._unseen: list[int] = []
        """Ranks found lost by this rank's own probes and not yet taken (`take_lost`)."""
        self.ended_lost: tuple[int, ...] = ()
        """The ranks lost as rank 0 ended the job (Shutdown.lost): every survivor ends the same way."""

    def alive(self, kind: str | None = None) -> list[int]:
        return [rank for rank, k in sorted(self.kind_of.items())
                if rank not in self.lost and (kind is None or k == kind)]

    def is_alive(self, rank: int) -> bool:
        return rank not in self.lost

    def mark_lost(self, rank: int, found: bool = False) -> bool:
        """Records a lost rank (`found`: by this rank's own MPI, else from rank 0's notice); True if new."""
        if rank in self.lost:
            return False
        self.lost[rank] = time.time()
        if found:
            self._unseen.append(rank)
        return True

    def take_lost(self) -> list[int]:
        """The ranks found lost since the last call, each once, in the order found."""
        out, self._unseen = self._unseen, []
        return out


class LiveComm:
    """The communicator a role holds: COMM_WORLD's calls that the loops make (Get_rank, isend, send, Iprobe, recv;
    collectives pass straight through: they run at start and at the end only), addressing ranks by world rank,
    with a peer's death recorded in the Membership instead of raised where the job survives it (module doc)."""

    def __init__(self, world, members: Membership):
        from mpi4py import MPI

        self.world, self.members = world, members
        self.rank = world.Get_rank()
        self.reporter = None
        """The rank's line to its supervisor (launch/monitor.py RankReporter): every probe tells it the loop
        turned (its heartbeat)."""
        self.any_source = MPI.ANY_SOURCE
        self._failed_classes: tuple[int, ...] = ()
        if members.tolerant:
            self._failed_classes = (MPI.ERR_PROC_FAILED, MPI.ERR_PROC_FAILED_PENDING, MPI.ERR_REVOKED)

    def __getattr__(self, name):  # Get_size, bcast, gather, Ibarrier, Split_type, Abort, ...
        return getattr(self.world, name)

    def Get_rank(self) -> int:
        return self.rank

    # ---- receiving ----
    def Iprobe(self, source: int, tag: int, status=None) -> bool:
        """MPI's Iprobe. A lost `source` raises RankLostError; a failure found while probing any source is
        recorded and the probe answers False (the next one probes again)."""
        if self.reporter is not None:
            self.reporter.turned()
        if source in self.members.lost:
            raise self._lost_error(source)
        try:
            return self.world.Iprobe(source=source, tag=tag, status=status)
        except Exception as exc:
            if not self.note_failure(exc):
                raise
            if source in self.members.lost:
                raise self._lost_error(source) from None
            return False

    def recv(self, buf=None, source: int = 0, tag: int = 0, status=None):
        try:
            return self.world.recv(buf, source=source, tag=tag, status=status)
        except Exception as exc:
            if not self.note_failure(exc):
                raise
            raise self._lost_error(source) from None

    # ---- sending ----
    def isend(self, obj, dest: int, tag: int):
        """A non-blocking send; to a lost rank, a request that is already complete (nothing is sent)."""
        if dest in self.members.lost:
            from mpi4py import MPI

            return MPI.REQUEST_NULL
        return self.world.isend(obj, dest=dest, tag=tag)

    def send(self, obj, dest: int, tag: int) -> None:
        """A blocking send; dropped if `dest` is or becomes lost (a tolerant job only)."""
        if dest in self.members.lost:
            return
        try:
            self.world.send(obj, dest=dest, tag=tag)
        except Exception as exc:
            if not self.note_failure(exc):
                raise

    def test_send(self, request, dest: int) -> bool:
        """Whether a posted send is done; one that failed because `dest` died counts as done (dropped)."""
        try:
            return request.Test()
        except Exception as exc:
            if not self.note_failure(exc):
                raise
            self.members.mark_lost(dest, found=True)
            return True

    def start_heartbeat(self, clock=None) -> None:
        """The role's loop starts: the heartbeat begins, and says which span of `clock` (a BusyClock) the rank is
        in."""
        if self.reporter is None:
            return
        if clock is not None:
            clock.watch = self.reporter.doing
        self.reporter.start_heartbeat()

    # ---- failures ----
    def note_failure(self, exc: BaseException) -> bool:
        """True if `exc` is MPI reporting a failed peer in a tolerant job: the failures are acknowledged (so that
        receives from anyone work again) and each failed rank recorded as found lost."""
        if not self._failed_classes or not hasattr(exc, "Get_error_class") \
                or exc.Get_error_class() not in self._failed_classes:
            return False
        for rank in self.acknowledge_failures():
            self.members.mark_lost(rank, found=True)
        return True

    def acknowledge_failures(self) -> list[int]:
        """World ranks MPI knows have failed, acknowledged (MPIX_Comm_ack_failed)."""
        from mpi4py import MPI

        self.world.Ack_failed()
        failed = self.world.Get_failed()
        try:
            world = self.world.Get_group()
            ranks = MPI.Group.Translate_ranks(failed, list(range(failed.Get_size())), world)
            world.Free()
        finally:
            failed.Free()
        return [rank for rank in ranks if rank != MPI.UNDEFINED]

    def _lost_error(self, rank: int) -> RankLostError:
        return RankLostError(rank, self.members.kind_of.get(rank, "?"))
