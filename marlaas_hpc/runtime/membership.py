"""Rank membership: who is in the job (alive, lost, joined), and the communicator every role talks through.

    world ranks     0 scheduler | env ranks | rollout ranks | trainer ranks        MPI COMM_WORLD, fixed at start
    joined ranks    N, N+1, ...  (rollout ranks started by rank 0 in the live job: MPI_Comm_spawn)
                    each reached over an intercommunicator of its own: from rank 0 the spawn's, from each env
                    rank and trainer leader one made by MPI_Comm_connect to the port the new rank opened

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

A joined rank (runtime/scaling.py) keeps the world's numbering: it is given the next free world rank, and a
LiveComm sends to it, and probes for what it sends, over its link (`add_link`), with the world rank as the
address; the joined rank's own LiveComm reaches every peer the same way. Joins and drains need the ULFM MPI's
dynamic processes: local mode, or `layout.mpi: ulfm` under Slurm (within the allocation, runtime/scaling.py); under
plain srun (no ULFM) the job's ranks are the ones it started with.
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
        self.drained = False
        """This rank alone left the live job (Shutdown 'drained': runtime/scaling.py)."""

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

    def join(self, rank: int, kind: str) -> None:
        """A rank that joined the live job (runtime/scaling.py)."""
        self.kind_of[rank] = kind


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
        self.links: dict[int, object] = {}
        """World rank -> the intercommunicator that reaches it (a joined rank, or from a joined rank its peers)."""
        self.any_source = MPI.ANY_SOURCE
        self._failed_classes: tuple[int, ...] = ()
        if members.tolerant:
            self._failed_classes = (MPI.ERR_PROC_FAILED, MPI.ERR_PROC_FAILED_PENDING, MPI.ERR_REVOKED)

    def __getattr__(self, name):  # Get_size, bcast, gather, Ibarrier, Split_type, Abort, ...
        return getattr(self.world, name)

    def Get_rank(self) -> int:
        return self.rank

    def add_link(self, rank: int, link) -> None:
        """`rank` is reached over `link`, an intercommunicator whose remote rank 0 it is (module doc)."""
        self.links[rank] = link

    def _route(self, rank: int):
        """(communicator, rank in it) that reach world rank `rank`."""
        link = self.links.get(rank)
        return (self.world, rank) if link is None else (link, 0)

    # ---- receiving ----
    def Iprobe(self, source: int, tag: int, status=None) -> bool:
        """MPI's Iprobe, by world rank, over COMM_WORLD and every link (the status's source is the world rank).
        A lost `source` raises RankLostError; a failure found while probing any source is recorded and the probe
        answers False (the next one probes again)."""
        if self.reporter is not None:
            self.reporter.turned()
        if source in self.members.lost:
            raise self._lost_error(source)
        if source != self.any_source:
            comm, peer = self._route(source)
            return self._probe(comm, peer, tag, status, source)
        if self._probe(self.world, source, tag, status, None):
            return True
        for rank, link in list(self.links.items()):
            if rank not in self.members.lost and self._probe(link, 0, tag, status, rank):
                return True
        return False

    def _probe(self, comm, source: int, tag: int, status, rank: int | None) -> bool:
        try:
            found = comm.Iprobe(source=source, tag=tag, status=status)
        except Exception as exc:
            if not self.note_failure(exc, rank if comm is not self.world else None):
                raise
            if rank is not None and rank in self.members.lost:
                raise self._lost_error(rank) from None
            return False
        if found and status is not None and comm is not self.world:
            status.source = rank
        return found

    def recv(self, buf=None, source: int = 0, tag: int = 0, status=None):
        comm, peer = self._route(source)
        try:
            return comm.recv(buf, source=peer, tag=tag, status=status)
        except Exception as exc:
            if not self.note_failure(exc, source if comm is not self.world else None):
                raise
            raise self._lost_error(source) from None

    # ---- sending ----
    def isend(self, obj, dest: int, tag: int):
        """A non-blocking send; to a lost rank, a request that is already complete (nothing is sent)."""
        if dest in self.members.lost:
            from mpi4py import MPI

            return MPI.REQUEST_NULL
        comm, peer = self._route(dest)
        return comm.isend(obj, dest=peer, tag=tag)

    def send(self, obj, dest: int, tag: int) -> None:
        """A blocking send; dropped if `dest` is or becomes lost (a tolerant job only)."""
        if dest in self.members.lost:
            return
        comm, peer = self._route(dest)
        try:
            comm.send(obj, dest=peer, tag=tag)
        except Exception as exc:
            if not self.note_failure(exc, dest if comm is not self.world else None):
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

    def apply(self, change) -> None:
        """Rank 0's RanksChanged on this rank: the lost and the joined ranks, and a link to each joined one if
        this rank is one of those it links to (env ranks and trainer leaders)."""
        for rank in change.lost:
            self.members.mark_lost(rank)
            if rank in change.left:
                self.disconnect(rank)
            else:
                self.links.pop(rank, None)  # dead: nothing to disconnect from
        for rank in change.joined:
            self.members.join(rank, "rollout")
            port = change.ports.get(rank, {}).get(self.rank)
            if port is not None and rank not in self.links:
                self.add_link(rank, connect_link(port, self.rank))

    def disconnect(self, rank: int) -> None:
        """Ends the link to a rank that leaves (MPI_Comm_disconnect: both ends call it; it waits for what is in
        flight on it). A process still linked to another cannot finalize MPI: it waits for it for ever."""
        link = self.links.pop(rank, None)
        if link is None:
            return
        try:
            link.Disconnect()
        except Exception as exc:  # the other end died meanwhile
            if not self.note_failure(exc, rank):
                raise

    def disconnect_all(self) -> None:
        """Every link, at the end, in one order over the whole job (pairs of ranks, lowest first): each disconnect
        waits for the other end, so two ranks taking their links in different orders could wait for each other."""
        for rank in sorted(self.links, key=lambda r: (min(r, self.rank), max(r, self.rank))):
            if rank in self.members.lost:
                self.links.pop(rank)
            else:
                self.disconnect(rank)

    def start_heartbeat(self, clock=None) -> None:
        """The role's loop starts: the heartbeat begins, and says which span of `clock` (a BusyClock) the rank is
        in."""
        if self.reporter is None:
            return
        if clock is not None:
            clock.watch = self.reporter.doing
        self.reporter.start_heartbeat()

    # ---- failures ----
    def note_failure(self, exc: BaseException, linked: int | None = None) -> bool:
        """True if `exc` is MPI reporting a failed peer in a tolerant job: on COMM_WORLD the failures are
        acknowledged (so that receives from anyone work again) and each failed rank recorded as found lost; on a
        link, its rank (`linked`) is."""
        if not self._failed_classes or not hasattr(exc, "Get_error_class") \
                or exc.Get_error_class() not in self._failed_classes:
            return False
        if linked is not None:
            self.members.mark_lost(linked, found=True)
            return True
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


# ---- joining the live job (MPI dynamic processes, ULFM local mode) ----
TAG_LINK = 19
"""The first message on a new link: the connecting rank's world rank."""


def spawn_rank(argv: list[str], host: str | None = None):
    """Rank 0: starts one process running `python argv...` in the job (MPI_Comm_spawn over COMM_SELF: no other
    rank takes part); returns the intercommunicator to it. Returns once the process is in MPI_Init (~1.3 s; 2-4 s
    under Slurm). `host`: the node it runs on (Info 'host': PRRTE starts it through that node's daemon)."""
    import sys

    from mpi4py import MPI

    if host is None:
        return MPI.COMM_SELF.Spawn(sys.executable, args=argv, maxprocs=1)
    info = MPI.Info.Create()
    try:
        info.Set("host", host)
        info.Set("map_by", "slot:OVERSUBSCRIBE")  # the node's slots all count as used (docs/architecture.md)
        return MPI.COMM_SELF.Spawn(sys.executable, args=argv, maxprocs=1, info=info)
    finally:
        info.Free()


def open_port() -> str:
    from mpi4py import MPI

    return MPI.Open_port()


def open_ports(peers) -> dict[int, str]:
    """A joining rank: a port of its own for each peer's link."""
    return {peer: open_port() for peer in peers}


def accept_links(ports: dict[int, str]) -> dict[int, object]:
    """A joining rank: each peer connects to its own port (accepted in rank order); world rank -> link to it."""
    from mpi4py import MPI

    links = {}
    for peer in sorted(ports):
        link = MPI.COMM_SELF.Accept(ports[peer])
        sent = link.recv(source=0, tag=TAG_LINK)
        if sent != peer:
            raise RuntimeError(f"rank {sent} connected to the port opened for rank {peer}")
        links[peer] = link
    return links


def connect_link(port: str, my_rank: int):
    """A peer of a joined rank: the link to it (blocks until it accepts)."""
    from mpi4py import MPI

    link = MPI.COMM_SELF.Connect(port)
    link.send(my_rank, dest=0, tag=TAG_LINK)
    return link
