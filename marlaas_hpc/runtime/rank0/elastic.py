"""Ranks that go and come, at rank 0: a worker lost in a tolerant job (runtime/membership.py), a whole trainer
group lost, rollout ranks joining (`marlaas scale`, `layout.rollout_replace`) and draining (runtime/scaling.py).
Each is an event like any other: the scheduler gets RankLost / RankJoined / RankLeaving and answers with commands;
every live worker gets RanksChanged before any of them, with the delta plane's new epoch; the change goes on record
(summary.json's ranks_lost / ranks_joined / ranks_left) and one line names it (a loss's line waits a moment for its
cause: the supervisor's report). The job stops (JobCannotGoOn) when no rank of a kind is left."""
from __future__ import annotations

import time

from marlaas_hpc.launch.layout import trainer_group_ranks
from marlaas_hpc.runtime.comm import recv_wait
from marlaas_hpc.runtime.faults import JobCannotGoOn, RankLostError
from marlaas_hpc.runtime.messages import (TAG_CMD, TAG_EVENT, DeltaPlaneFailed, FeedWeights, Joining, LinkTo,
                                          RanksChanged, RankStats, Shutdown, WeightsPlan, WeightsWanted)
from marlaas_hpc.runtime.scaling import Scaler
from marlaas_hpc.scheduler import Discard, RankJoined, RankLeaving, RankLost


class ElasticRanks:
    """`handle(event) -> commands` and `execute(commands)` are rank 0's; `event(event)` handles one worker event
    (a draining rank's last words are handled as they come)."""

    LOSS_CAUSE_WAIT_S = 3.0
    """How long a loss's line waits for its cause (the supervisor writes it as the rank's monitor line ends)."""

    def __init__(self, comm, job, run_dir, scheduler, books, outbox, log, evals, handle, execute, event,
                 rank_models=None, resume: dict | None = None):
        self.comm, self.job, self.run_dir, self.scheduler, self.books = comm, job, run_dir, scheduler, books
        self.outbox, self.log, self.evals, self.rank_models = outbox, log, evals, rank_models
        self.handle, self.execute, self.event = handle, execute, event
        self.members = comm.members
        """Who is alive (runtime/membership.py): rank 0 acts on each loss its MPI reports."""
        self.groups = trainer_group_ranks(job.layout)
        self.leaders = [ranks[0] for ranks in self.groups]
        """World rank of each trainer group's leader, by group."""
        self.lost_groups: set[int] = set()
        self.delta_epoch = 0
        """Changes of the rollout ranks so far: the delta plane's epoch (RanksChanged)."""
        self.delta_part = None
        """The delta plane's part hosted here (with several trainer groups, the job's DeltaOrder): kept alive."""
        self.scaler = Scaler(comm, job, run_dir, log)
        """Rollout ranks joining, draining and wanted, and in local mode which GPUs each holds (runtime/scaling.py)."""
        self.ranks_lost: list[dict] = list(resume.get("ranks_lost", [])) if resume else []
        """Ranks the live job went on without, this run's and earlier runs' (summary.json)."""
        self.ranks_joined: list[dict] = list(resume.get("ranks_joined", [])) if resume else []
        self.ranks_left: list[dict] = list(resume.get("ranks_left", [])) if resume else []
        self.unnamed: list[dict] = []
        """Losses whose one line waits for the cause (the supervisor's report, a moment after MPI's)."""
        self.parting: list = []
        """Sends to the ranks of a lost trainer group that still live (they end themselves on it)."""

    # ---- who is live ----
    def live_leaders(self) -> list[int]:
        return [leader for group, leader in enumerate(self.leaders) if group not in self.lost_groups]

    def live_workers(self) -> list[int]:
        """The ranks rank 0 talks to (env, rollout, trainer leaders) that are alive."""
        return [rank for rank in self.members.alive() if rank != 0
                and (self.members.kind_of[rank] != "trainer" or rank in self.leaders)]

    def view(self) -> dict:
        """status.json's ranks: the live ones per role, and those that joined."""
        return {"rollout": self.members.alive("rollout"), "env": self.members.alive("env"),
                "joined": [r["rank"] for r in self.ranks_joined], "lost": sorted(self.members.lost)}

    def _notify(self, notice: RanksChanged) -> None:
        for worker in self.live_workers():  # before any command that depends on it
            self.outbox.send(notice, worker, TAG_CMD)

    # ---- losses ----
    def losses(self) -> None:
        for rank in self.members.take_lost():
            self._rank_lost(rank)
        if self.unnamed:
            self.name_losses()

    def _rank_lost(self, rank: int) -> None:
        """The scheduler's RankLost, the workers' RanksChanged, evals sent again, the record; the line follows
        once the cause is known (`name_losses`)."""
        if self.scaler.joining.get(rank) is not None:
            self.scaler.forget(rank)
            self.scaler.release(rank)
            self.log(f"[scale] rank {rank} failed before it joined")
            self._feed_weights()  # the others of its batch may be waiting for it
            return
        kind = self.members.kind_of[rank]
        if kind == "trainer":
            self._trainer_group_lost(rank)
            return
        if kind not in ("env", "rollout"):
            raise JobCannotGoOn(f"the job does not go on without a {kind} rank")
        self.scaler.draining.discard(rank)
        slot = self.scaler.release(rank)
        replaced = None
        if kind == "rollout" and self.job.layout.rollout_replace and self.scaler.able:
            why_not = self.scaler.cannot_spawn()
            if why_not is None:
                replaced = self._spawn(f"to replace rank {rank} (layout.rollout_replace)", slot, replaces=rank)
            else:
                self.log(f"[scale] rank {rank} is not replaced: {why_not}")
        if not self.members.alive(kind) and replaced is None:
            raise JobCannotGoOn(f"no {kind} rank is left")
        commands = self.handle(RankLost(rank, kind))
        if kind == "rollout":
            self.delta_epoch += 1
            if self.rank_models is not None:
                self.rank_models.lost(rank)
        self._notify(RanksChanged(self.delta_epoch, tuple(self.members.alive("rollout")), lost=(rank,)))
        loss = {"rank": rank, "role": kind, "at": time.time(), "cause": None,
                "groups_reissued": [gid for c in commands if isinstance(c, Discard) for gid in c.group_ids],
                "evals_resent": self.evals.resend(rank, kind)}
        self._on_record(loss)
        self.execute(commands)

    def _on_record(self, loss: dict) -> None:
        self.books.records.rank_lost(loss)
        self.ranks_lost.append(loss)
        self.unnamed.append(loss)

    def _trainer_group_lost(self, rank: int) -> None:
        """The rank's whole trainer group is gone (a TP or DP group cannot go on short of a rank): its ranks still
        alive are told to end, and every task it owned goes back to its newest checkpoint and is admitted again
        on a surviving group; the other groups' tasks go on."""
        group = next(g for g, ranks in enumerate(self.groups) if rank in ranks)
        if group in self.lost_groups:
            return
        self.lost_groups.add(group)
        for member in self.groups[group]:
            self.members.mark_lost(member)
        if len(self.lost_groups) == len(self.groups):
            raise JobCannotGoOn("no other trainer group is left to take its tasks")
        records = self.books.records.tasks
        owned = {t: task.version for t, task in self.scheduler.tasks.items() if task.status == "running"
                 and group in (task.trainer_group, self.scheduler.trainers.moving.get(t))}
        commands = self.handle(RankLost(rank, "trainer", group, {t: records[t]["saved"] for t in owned}))
        back = {t: [max(version, 0), records[t]["saved"]["version"] or 0] for t, version in owned.items()}
        for task_id, (_, version) in back.items():
            self.books.roll_back(self.scheduler.tasks[task_id], version)
        self.delta_epoch += 1
        notice = RanksChanged(self.delta_epoch, tuple(self.members.alive("rollout")), lost=tuple(self.groups[group]),
                              rolled_back=tuple(back))
        self._notify(notice)
        self.parting.append(self.comm.world.isend(notice, dest=self.leaders[group], tag=TAG_CMD))
        self._on_record({"rank": rank, "role": f"trainer (group {group})", "trainer_group": group, "at": time.time(),
                         "cause": None,
                         "groups_reissued": [g for c in commands if isinstance(c, Discard) for g in c.group_ids],
                         "evals_resent": [], "tasks_rolled_back": back})
        self.books.status.ranks = self.view()
        self.execute(commands)

    def delta_plane_failed(self, event: DeltaPlaneFailed) -> None:
        """A leader's delta plane of an epoch could not be set up (a member lost meanwhile): a new epoch over the live
        rollout ranks, once per epoch (a newer one under way already carries the remake)."""
        self.log(f"[fault] trainer group {event.group}: delta plane of epoch {event.epoch} not set up ({event.why})"
                 + ("" if event.epoch < self.delta_epoch else f"; remade as epoch {self.delta_epoch + 1}"))
        if event.epoch < self.delta_epoch:
            return
        self.delta_epoch += 1
        self._notify(RanksChanged(self.delta_epoch, tuple(self.members.alive("rollout"))))

    def name_losses(self, wait_s: float | None = None) -> None:
        """The one line of each loss whose cause is known now (or that waited long enough)."""
        from marlaas_hpc.launch.supervise import loss_cause

        wait_s = self.LOSS_CAUSE_WAIT_S if wait_s is None else wait_s
        for loss in list(self.unnamed):
            cause = loss_cause(self.run_dir, loss["rank"])
            if cause is None and time.time() - loss["at"] < wait_s:
                continue
            self.unnamed.remove(loss)
            loss["cause"] = cause or "lost without a report from the supervisor (no supervisor, or it came late)"
            self.books.records.rank_lost(loss)
            self.log(self._loss_line(loss))

    def _loss_line(self, loss: dict) -> str:
        groups, evals = loss["groups_reissued"], loss["evals_resent"]
        shown = ", ".join(groups[:6]) + (", ..." if len(groups) > 6 else "")
        back = loss.get("tasks_rolled_back")
        kind = "trainer" if back is not None else loss["role"]
        went_back = "; tasks back to their checkpoint: " + (", ".join(
            f"{t} v{a} -> v{b}" for t, (a, b) in back.items()) or "none") if back is not None else ""
        return (f"[fault] rank {loss['rank']} ({loss['role']}) lost: {loss['cause']}{went_back}; {len(groups)} "
                f"groups issued again" + (f" ({shown})" if groups else "") + f", {len(evals)} eval prompts sent "
                f"again; the job goes on with {kind} ranks {self.members.alive(kind)}")

    # ---- rollout ranks joining and leaving (runtime/scaling.py) ----
    def scale(self) -> None:
        wanted = self.scaler.requested()
        if wanted is not None:
            self._rescale(wanted)
        for rank in [r for r in self.scaler.draining if self._drained(r)]:
            self._leave(rank)

    def _rescale(self, wanted: int) -> None:
        """`marlaas scale --rollout N`: ranks are started (they join once up) or drained (newest first)."""
        if not self.scaler.able:
            self.log(f"[scale] rollout ranks {wanted} asked for, not done: ranks join and leave a live job only on "
                     f"the fault-tolerant MPI (local mode, or layout.mpi: ulfm under Slurm) ({self.scaler.why_not})")
            return
        live = [r for r in self.members.alive("rollout") if r not in self.scaler.draining] + list(self.scaler.joining)
        more = max(wanted, 1) - len(live)
        free = self.scaler.free_slots()
        if self.scaler.in_allocation and more > len(free):
            self.log(f"[scale] rollout ranks {wanted} asked for, not done: {len(live)} run and the allocation's "
                     f"rollout component has {len(free)} free slot(s) of {len(self.scaler.slots)} (a rank joins "
                     "only in a slot whose rank was lost or drained; a job that joins from outside is not done)")
            return
        if more > 0 and self.scaler.cannot_spawn(more):
            self.log(f"[scale] rollout ranks {wanted} asked for, not done: {self.scaler.cannot_spawn(more)}")
            return
        drainable = [r for r in live if r not in self.scaler.joining and self.scaler.may_leave(r)]
        if len(live) - wanted > len(drainable):
            self.log(f"[scale] rollout ranks {wanted} asked for, not done: {self.scaler.stays_why()}; "
                     f"{len(drainable)} of the {len(live)} could drain")
            return
        self.log(f"[scale] rollout ranks: {len(live)} -> {max(wanted, 1)}")
        for i in range(more):
            self._spawn("", free[i] if self.scaler.in_allocation else None)
        for rank in sorted(drainable, reverse=True)[:max(len(live) - wanted, 0)]:
            self.scaler.draining.add(rank)
            if self.rank_models is not None:  # several models: it leaves the model pool's split now
                self.rank_models.leaving(rank)
            self.execute(self.handle(RankLeaving(rank)))
            self.log(f"[scale] rollout rank {rank} drains: no new group; it leaves once its groups are done")

    def _spawn(self, why: str, slot: int | None, replaces: int | None = None) -> int | None:
        """Starts one rollout rank (in `slot` under Slurm; in local mode on the GPUs of the rank it `replaces`, or
        free ones) and says so; None if it could not start."""
        from mpi4py import MPI

        from marlaas_hpc.launch.devices import DeviceError

        try:
            rank, host = self.scaler.spawn(slot, replaces)
        except (MPI.Exception, DeviceError) as exc:  # no room on the node, no free GPU, ...: the slot stays free
            where = "" if slot is None else f" in rank {slot}'s slot"
            self.log(f"[scale] could not start a rollout rank {why}".rstrip() + f"{where}: {exc}")
            return None
        where = f" on {host} in rank {slot}'s slot" if host else ""
        self.log(f"[scale] starting rollout rank {rank} {why}".rstrip() + where)
        return rank

    def _drained(self, rank: int) -> bool:
        return self.scheduler.rank_idle(rank) and not self.evals.on_rank(rank)

    def _leave(self, rank: int) -> None:
        """A drained rollout rank leaves: Shutdown('drained') to it, then it is gone from every communicator."""
        self.scaler.draining.discard(rank)
        self.outbox.send(Shutdown("drained"), rank, TAG_CMD)
        try:
            while True:  # what it says until its RankStats (on a link, what is not received is lost at disconnect)
                event, _ = recv_wait(self.comm, TAG_EVENT, source=rank)
                self.event(event)
                if isinstance(event, RankStats):
                    break
            self.comm.disconnect(rank)  # a joined rank: its link (it disconnects once it has the Shutdown)
        except RankLostError:  # it died meanwhile: idle, it held nothing
            self.comm.links.pop(rank, None)
        self.members.mark_lost(rank)
        self.scaler.release(rank)
        commands = self.handle(RankLost(rank, "rollout"))
        if self.rank_models is not None:
            self.rank_models.lost(rank)
        self.delta_epoch += 1
        self._notify(RanksChanged(self.delta_epoch, tuple(self.members.alive("rollout")), lost=(rank,), left=(rank,)))
        record = {"rank": rank, "role": "rollout", "at": time.time(), "why": "drained (marlaas scale)"}
        self.books.records.history("rank_left", record)
        self.ranks_left.append(record)
        self.books.status.ranks = self.view()
        self.log(f"[scale] rollout rank {rank} drained and left; rollout ranks {self.members.alive('rollout')}")
        self.execute(commands)

    def joined(self, event: Joining) -> None:
        """A started rank's engine is up: it is told who links to it (LinkTo), and opens a port for each. Then
        every worker is told (env ranks and leaders link to it, leaders remake their delta channels with it), and
        the scheduler gives it groups."""
        rank = event.rank
        if event.ports is None:
            self.outbox.send(LinkTo(tuple(self.members.alive("env") + self.live_leaders())), rank, TAG_CMD)
            return
        spawned = self.scaler.joining.get(rank, time.time())
        self.scaler.forget(rank)
        self.members.join(rank, "rollout")
        self.delta_epoch += 1
        self._notify(RanksChanged(self.delta_epoch, tuple(self.members.alive("rollout")), joined=(rank,),
                                  ports={rank: event.ports}))
        record = {"rank": rank, "role": "rollout", "at": time.time(), "start_s": time.time() - spawned}
        self.books.records.history("rank_joined", record)
        self.ranks_joined.append(record)
        self.books.status.ranks = self.view()
        self.log(f"[scale] rollout rank {rank} joined {record['start_s']:.1f} s after it was started; rollout ranks "
                 f"{self.members.alive('rollout')}")
        if self.rank_models is not None:  # several models: it enters the pool; its Serve goes before its groups
            self.execute(self.rank_models.joined(rank, time.time(), self.evals.in_flight()))
        self.execute(self.handle(RankJoined(rank)))

    def weights_wanted(self, event: WeightsWanted) -> None:
        self.scaler.wanting[event.rank] = event.port
        self._feed_weights()

    def _feed_weights(self) -> None:
        """Every joiner started together asked for the base weights: one live rollout rank feeds the first, each
        feeds the next (runtime/peer_weights.py); rank 0 sends only these few lines. No live rollout rank to feed
        them (none, or only draining ones): each reads the disk."""
        chain = self.scaler.weights_chain()
        if chain is None:
            return
        sources = [r for r in self.members.alive("rollout") if r not in self.scaler.draining]
        ports = {rank: self.scaler.wanting.pop(rank) for rank in chain}
        if not sources:
            self.log(f"[scale] no live rollout rank to send the base weights to {chain}: they read the disk")
            for rank in chain:
                self.outbox.send(WeightsPlan(None), rank, TAG_CMD)
            return
        source = sources[-1]
        self.outbox.send(FeedWeights(chain[0], ports[chain[0]]), source, TAG_CMD)
        for feeder, rank, after in zip([source] + chain, chain, chain[1:] + [None]):
            self.outbox.send(WeightsPlan(feeder, after, ports.get(after)), rank, TAG_CMD)
        self.log(f"[scale] base weights: rollout rank {source} -> " + " -> ".join(map(str, chain)))
