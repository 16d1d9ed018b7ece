"""World rank 0: the Scheduler state machine (scheduler/core.py, pure) behind a thin MPI loop over rank 0's
components (runtime/rank0/):

    loop turn:  outbox progress ─► Intake (queue dir, one start spec) ─► one worker event ─► ElasticRanks (losses,
                joins, drains) ─► model pool plan ─► RunBooks tick (status.json) ─► quiet-log line when due

    event ──► SchedulerRank._event ──► a component's answer, or Scheduler.handle ──► commands ──► _execute (MPI)

It writes the job's outputs through its RunBooks (runtime/outputs.py): the audit as steps land, the records a resume
starts from as tasks are submitted, saved and ended (runtime/records.py), status.json about once a second, and
summary.json at the end. Its work per event does not grow with the number of tasks; its own BusyClock
(timeline/rank0.jsonl, summary.json's busy_fraction 'scheduler') shows where its time goes."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from marlaas_hpc.model import TextCodec
from marlaas_hpc.runtime.checkpoint import PreemptFlag, mark_preempted
from marlaas_hpc.runtime.comm import BusyClock, Outbox, poll, write_timeline
from marlaas_hpc.runtime.messages import (TAG_CMD, TAG_EVENT, CheckpointDone, DeltaPlaneFailed, EngineRestarted,
                                          EvalDone, Joining, RankStats, Shutdown, TaskSaved, WeightsWanted, to_event,
                                          to_wire)
from marlaas_hpc.runtime.outputs import QuietLog, RunBooks, write_summary
from marlaas_hpc.runtime.rank0.elastic import ElasticRanks
from marlaas_hpc.runtime.rank0.evals import Evals
from marlaas_hpc.runtime.rank0.inputs import TaskInputs
from marlaas_hpc.runtime.rank0.intake import Intake
from marlaas_hpc.runtime.rank0.preemption import Preemption
from marlaas_hpc.runtime.recovery import crashed_run, rollback_outputs
from marlaas_hpc.scheduler import Admit, Discard, Generate, Move, Scheduler, StepDone, TaskEnded, Train
from marlaas_hpc.scheduler.rank_models import RankModels, Serve, Served


@dataclass
class Tally:
    """Rank 0's own figures for summary.json."""

    start: float
    startup_s: float
    events: int = 0
    """Scheduler events handled (what the simulator charges rank 0 for)."""
    stats: list[RankStats] = field(default_factory=list)
    """Every worker's RankStats."""


class SchedulerRank:
    def __init__(self, comm, job, roles: dict[str, list[int]], codec: TextCodec, run_dir: Path, log=print,
                 startup_s: float = 0.0, preempt: PreemptFlag | None = None, resume: dict | None = None,
                 model_codecs: dict[str, TextCodec] | None = None):
        self.comm, self.job, self.run_dir, self.log = comm, job, Path(run_dir), QuietLog(log)
        self.outbox = Outbox(comm)
        self.tally = Tally(time.time(), startup_s)
        self.busy = BusyClock()
        """Rank 0's own busy time: 'event' (a scheduler event handled, its commands out), 'eval' (an eval
        result), 'admit' (a task's data loaded and submitted), 'intake', 'status', 'end'."""
        self.scheduler = Scheduler(job.scheduler_config(roles["rollout"], roles["env"]), clock=time.time)
        if resume:  # before the audit is opened for appending: steps after a task's checkpoint are trained again
            self.scheduler.audit.extend(rollback_outputs(self.run_dir, resume))
        self.books = RunBooks(self.run_dir, job, self.scheduler, resume, self.tally.start)
        if resume and (crashed := crashed_run(resume, self.run_dir)):
            self.books.records.runs.append(crashed)
        self.books.records.open_run(self.tally.start, startup_s)  # on record before anything can crash
        self.inputs = TaskInputs(job, self.scheduler, codec, model_codecs)
        models = list(job.model_names())
        self.rank_models = (RankModels(self.scheduler, models, multi_turn=self.inputs.multi_turn)
                            if len(models) > 1 else None)
        """A job of several base models: which model each rollout rank serves (scheduler/rank_models.py)."""
        self.intake = Intake(job, self.run_dir, self.scheduler, self.inputs, self.books.records, self._handle,
                             self._execute, self.busy, self.log)
        self.evals = Evals(self.scheduler, self.inputs, self.outbox, self.books.records, self.log, self.rank_models,
                           scores=self.intake.start(resume, len(self.runs)))
        self.ranks = ElasticRanks(comm, job, self.run_dir, self.scheduler, self.books, self.outbox, self.log,
                                  self.evals, self._handle, self._execute, self._event, self.rank_models, resume)
        self.preemption = Preemption(preempt, self.scheduler, self.outbox, self.books.records, self.log)

    @property
    def runs(self) -> list[dict]:
        """Earlier runs of this job (each ended by a preemption or a crash), oldest first."""
        return self.books.records.runs

    @property
    def delta_order(self):
        return self.ranks.delta_part

    @delta_order.setter
    def delta_order(self, part) -> None:
        self.ranks.delta_part = part

    def _handle(self, event) -> list:
        """The scheduler's handling of an event, and what it changes in the run dir (RunBooks.handled: records
        written before any command that depends on them goes out)."""
        commands = self.scheduler.handle(event)
        self.tally.events += 1
        self.books.handled(event, commands)
        return commands

    # ---- loop ----
    def run(self) -> dict:
        """The loop: one start spec submitted (while any is left), one event handled, status.json when due."""
        if self.rank_models is not None:
            self._execute(self.rank_models.start())
        while self.intake.starting or not self._all_done() or self._serving():
            if self.preemption.done(bool(self.evals.pending), self.ranks.live_leaders()):
                break
            self.outbox.progress()
            self.intake.poll(self.tally.start)
            if self.intake.starting:
                self.intake.submit_next()
            event, source = poll(self.comm, TAG_EVENT)
            if source in self.ranks.members.lost and not isinstance(event, RankStats):
                event = None  # a lost rank's last words: what it said is forgotten, or done again elsewhere
            if event is not None:
                with self.busy.track("eval" if isinstance(event, EvalDone) else "event"):
                    self._event(event)
            if self.ranks.members.tolerant:
                self.ranks.losses()
            self.ranks.scale()
            if self.rank_models is not None and self.rank_models.due(time.time()):
                self._plan_models()
            self.books.tick(self.busy)
            self.log.tick(self.scheduler)
            if event is None and not self.intake.pending():
                time.sleep(0.002)
        self._finish_run()
        return self._end()

    def _all_done(self) -> bool:
        return self.scheduler.finished() and not self.evals.pending

    def _serving(self) -> bool:
        return self.intake.serving(self.tally.start, bool(self.evals.pending))

    def _finish_run(self) -> None:
        """Every worker shut down, its RankStats in (a worker lost meanwhile sends none)."""
        members = self.ranks.members
        lost = members.ended_lost = tuple(sorted(members.lost))
        for rank in members.alive():
            if rank != 0:
                self.outbox.send(Shutdown(lost=lost), rank, TAG_CMD)
        waiting = set(self.ranks.live_workers())  # one per trainer group: its leader
        while waiting:
            event, _ = poll(self.comm, TAG_EVENT)
            if isinstance(event, RankStats):
                self.tally.stats.append(event)
                waiting.discard(event.rank)
            elif event is None:
                time.sleep(0.005)
            waiting -= set(members.lost)
        self.ranks.name_losses(wait_s=0.0)
        self.outbox.flush()

    def _end(self) -> dict:
        """The run's outputs, once each: records (one compaction), audit, status.json, summary.json, rank 0's
        timeline."""
        wall = time.time() - self.tally.start
        preempted = self.preemption.checkpointed is not None
        run_dir, earlier = self.run_dir, list(self.runs)
        with self.busy.track("end"):
            self.books.close({"started": self.tally.start, "wall_time_s": wall, "startup_s": self.tally.startup_s,
                              "ended": "preempted" if preempted else "finished"}, finished=not preempted)
            if preempted:
                mark_preempted(run_dir)
        stages = {stage: {"busy_s": busy, "count": count} for stage, (busy, count) in self.busy.stages.items()}
        mine = RankStats(0, "scheduler", self.busy.busy, wall, {
            "events": self.tally.events, "record_bytes": self.books.records.journal.bytes_written, "stages": stages})
        summary = write_summary(run_dir, self.job, self.scheduler, self.evals.scores, self.tally.stats + [mine], wall,
                                self.intake.rejected, self.tally.startup_s, job_start=self.tally.start, runs=earlier,
                                preempted=preempted, ranks_lost=self.ranks.ranks_lost,
                                ranks_joined=self.ranks.ranks_joined, ranks_left=self.ranks.ranks_left)
        write_timeline(run_dir, 0, "scheduler", self.busy)
        if preempted:
            versions = {t: max(s.version, 0) for t, s in self.scheduler.tasks.items()}
            self.log(f"[job] preempted: every task checkpointed at {versions}; resume with "
                     f"`marlaas run --resume {run_dir}` (under Slurm the job requeues itself)")
        return summary

    # ---- events ----
    def _event(self, message) -> None:
        """A worker's event (its wire form made the scheduler's: `to_event`): to the component it concerns, or to
        the scheduler (its commands go out)."""
        event = to_event(message)
        answer = self.ANSWERS.get(type(event))
        if answer is not None:
            answer(self, event)
            return
        commands = self._handle(event)
        if isinstance(event, StepDone) and event.metrics:  # a trained step (not an admission)
            task = self.scheduler.tasks[event.task_id]
            self.log(f"[{event.task_id}] v{event.version}/{task.spec.total_steps} reward "
                     f"{event.metrics.get('reward_mean', 0):.3f} staleness<={event.metrics.get('staleness_max', 0)} "
                     f"(k={task.bound}) loss {event.metrics.get('loss', 0):+.4f}")
        self._execute(commands)

    ANSWERS = {
        EvalDone: lambda self, e: self.evals.done(e),
        RankStats: lambda self, e: self.tally.stats.append(e),
        WeightsWanted: lambda self, e: self.ranks.weights_wanted(e),
        Joining: lambda self, e: self.ranks.joined(e),
        CheckpointDone: lambda self, e: self.preemption.answered(e, len(self.ranks.live_leaders())),
        TaskSaved: lambda self, e: self.books.task_saved(e.task_id, e.version),
        Served: lambda self, e: self._served(e),
        DeltaPlaneFailed: lambda self, e: self.ranks.delta_plane_failed(e),
        EngineRestarted: lambda self, e: self._engine_restarted(e)}
    """Events that are not the scheduler's, by type, to the component that answers them."""

    def _engine_restarted(self, event: EngineRestarted) -> None:
        self.log(f"[job] rollout rank {event.rank}: engine error ({event.cause}); engine restarted "
                 f"(restart {event.restarts}), {event.requests} requests re-issued")

    # ---- commands ----
    def _leader_of(self, task_id: str) -> int:
        """The leader of the trainer group that owns the task now (group 0 before its admission)."""
        return self.ranks.leaders[self.scheduler.trainer_group(task_id) or 0]

    def _execute(self, commands: list) -> None:
        """Each command to the ranks it concerns, in its wire form (`to_wire`)."""
        leaders, env_ranks = self.ranks.leaders, self.ranks.members.alive
        for command in commands:
            wire = to_wire(command)
            if isinstance(command, Admit):
                for rank in env_ranks("env") + [leaders[command.trainer_group]]:
                    self.outbox.send(wire, rank, TAG_CMD)
                self.evals.admitted(command.spec.task_id)
            elif isinstance(command, Generate):
                self.outbox.send(self.inputs.work(command), command.rollout_rank, TAG_CMD)
                self.evals.generated(command.task_id)  # after the task's first groups, not before
            elif isinstance(command, Train):
                self.outbox.send(wire, leaders[command.trainer_group], TAG_CMD)
            elif isinstance(command, Serve):  # before any Generate of its model to the rank (same tag: in order)
                now = time.time()
                self.busy.note("serve", (), now, now, rollout_rank=command.rollout_rank, model=command.model)
                self.outbox.send(wire, command.rollout_rank, TAG_CMD)
            elif isinstance(command, Discard):
                self.outbox.send(wire, self._leader_of(command.task_id), TAG_CMD)
            elif isinstance(command, Move):  # the old group hands the task over; env ranks send its data anew
                self.log(f"[{command.task_id}] moves from trainer group {command.from_group} to "
                         f"{command.to_group} at v{command.version}")
                for rank in [leaders[command.from_group]] + env_ranks("env"):
                    self.outbox.send(wire, rank, TAG_CMD)
            elif isinstance(command, TaskEnded):
                self._ended(command)

    def _ended(self, command: TaskEnded) -> None:
        task = self.scheduler.tasks[command.task_id]
        if command.status == "failed":
            self.evals.task_failed(command.task_id)
        self.log(f"[{command.task_id}] {command.status} at v{max(task.version, 0)}"
                 + (f": {command.error}" if command.error else ""))
        if task.version > 0 and command.status != "failed":
            self.evals.send(command.task_id, task.version)
        self.outbox.send(to_wire(command), self._leader_of(command.task_id), TAG_CMD)

    # ---- several base models: rank 0's model pool (scheduler/rank_models.py) ----
    def _plan_models(self) -> None:
        """The model pool's plan: ranks drained, reopened or told to switch (Serve)."""
        with self.busy.track("models"):
            self._execute(self.rank_models.tick(time.time(), self.evals.in_flight()))

    def _served(self, event: Served) -> None:
        """A rank serves its assigned model now: it is filled, and that model's held-back evals go to it."""
        now = time.time()
        self.busy.note("served", (), now, now, rollout_rank=event.rollout_rank, model=event.model,
                       sleep_s=event.sleep_s, wake_s=event.wake_s)
        commands, works = self.rank_models.served(event, now)
        self._execute(commands)
        self.evals.served(event.rollout_rank, works)
