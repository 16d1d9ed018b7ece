"""World rank 0: the Scheduler state machine behind a thin MPI loop. It owns the task data (prompts go out
with Generate commands), routes commands, prints progress, runs evals and writes the job's outputs through its
RunBooks (runtime/outputs.py): the audit as steps land, the records a resume starts from as tasks are submitted,
saved and ended (runtime/records.py), status.json about once a second, and summary.json at the end. Its work per
event does not grow with the number of tasks; its own BusyClock (timeline/rank0.jsonl, summary.json's
busy_fraction 'scheduler') shows where its time goes.

A worker rank lost in a tolerant job (runtime/membership.py) is an event like any other: the scheduler gets
RankLost and answers with commands (its unscored groups issued again, Discards), every live worker gets
RanksChanged before any of them, eval prompts it held are sent again, the loss goes on record (a `rank_lost`
record, summary.json's ranks_lost), and one line names the rank, its role, the cause (its supervisor's report,
`launch/supervise.py` loss_cause) and what was issued again. The job stops (JobCannotGoOn) when no rank of that
kind is left."""
from __future__ import annotations

import dataclasses
import time
from collections import deque
from pathlib import Path

from marlaas_hpc.env.protocol import first_prompt, is_multi_turn
from marlaas_hpc.env.tenant_code import check_reward_code
from marlaas_hpc.launch.layout import trainer_group_ranks
from marlaas_hpc.model import TextCodec
from marlaas_hpc.runtime.checkpoint import PreemptFlag, mark_preempted
from marlaas_hpc.runtime.comm import BusyClock, Outbox, poll, recv_wait, write_timeline
from marlaas_hpc.runtime.faults import JobCannotGoOn, RankLostError
from marlaas_hpc.runtime.messages import (TAG_CMD, TAG_EVENT, Checkpoint, CheckpointDone, DeltaPlaneFailed,
                                          EngineRestarted, EvalDone, FeedWeights, GenerateWork, Joining, LinkTo,
                                          PromptGroup, RanksChanged, RankStats, Shutdown, TaskSaved, WeightsPlan,
                                          WeightsWanted)
from marlaas_hpc.runtime.scaling import Scaler
from marlaas_hpc.runtime.outputs import QuietLog, RunBooks, write_summary
from marlaas_hpc.runtime.recovery import crashed_run, rollback_outputs
from marlaas_hpc.scheduler import (Admit, Cancel, Discard, Generate, Move, RankJoined, RankLeaving, RankLost,
                                   Scheduler, StepDone, Submit, TaskEnded, Train)
from marlaas_hpc.scheduler.rank_models import RankModels, Serve, Served
from marlaas_hpc.service import QueueIntake
from marlaas_hpc.env import build_task_data
from marlaas_hpc.tasks import SpecError
from marlaas_hpc.tasks.spec import check_trained, with_base_model


class SchedulerRank:
    def __init__(self, comm, job, roles: dict[str, list[int]], codec: TextCodec, run_dir: Path, log=print,
                 startup_s: float = 0.0, preempt: PreemptFlag | None = None, resume: dict | None = None,
                 model_codecs: dict[str, TextCodec] | None = None):
        self.comm, self.job, self.roles, self.codec = comm, job, roles, codec
        self.model_codecs = model_codecs or {}
        """Per base model (a job of several): the codec of its tokenizer; a model not here uses `codec`."""
        self.run_dir, self.log = Path(run_dir), QuietLog(log)
        self.outbox = Outbox(comm)
        self.start = time.time()
        self.busy = BusyClock()
        """Rank 0's own busy time: 'event' (a scheduler event handled, its commands out), 'eval' (an eval
        result), 'admit' (a task's data loaded and submitted), 'intake', 'status', 'end'."""
        self.events = 0
        """Scheduler events handled (what the simulator charges rank 0 for)."""
        self.startup_s = startup_s
        self.scheduler = Scheduler(job.scheduler_config(roles["rollout"], roles["env"]), clock=time.time)
        self.leaders = [ranks[0] for ranks in trainer_group_ranks(job.layout)]
        """World rank of each trainer group's leader, by group."""
        self.checkpoints: dict[str, int] = {}
        self.checkpoint_answers = 0
        self.data: dict = {}
        self.codecs: dict[str, TextCodec] = {}
        """Per task: the codec of its prompt format (raw or chat)."""
        self.rejected: dict[str, str] = {}
        self.evals: dict[tuple[str, str], list[float]] = {}
        self.pending_evals: dict[tuple[str, str], int] = {}
        self.base_evals_due: set[str] = set()
        """Admitted tasks whose base-model eval goes out with their first Generate: sent at admission, a thousand
        tasks' evals stood in the rollout queue before any task's first groups."""
        self.stats: list[RankStats] = []
        self._eval_turn = 0
        self.preempt = preempt or PreemptFlag()
        self.resume = resume
        if resume:
            # before the audit is opened for appending: steps after a task's checkpoint are trained again
            self.scheduler.audit.extend(rollback_outputs(self.run_dir, resume))
        self.books = RunBooks(self.run_dir, job, self.scheduler, resume, self.start)
        if resume:
            crashed = crashed_run(resume, self.run_dir)
            if crashed:
                self.books.records.runs.append(crashed)
        self.books.records.open_run(self.start, startup_s)  # on record before anything can crash
        self.starting: deque = deque()
        """Start specs not submitted yet (`_start_specs`)."""
        self.taken: deque = deque()
        """Queue entries taken and checked, not submitted yet: (entry, spec or None, why refused or None)."""
        self.checkpoint_sent = False
        self.checkpointed: dict[str, int] | None = None
        self.intake = QueueIntake(job, self.run_dir)
        self.members = comm.members
        """Who is alive (runtime/membership.py): rank 0 acts on each loss its MPI reports."""
        self.eval_out: dict[str, tuple[GenerateWork, int]] = {}
        """Eval prompt group -> (a GenerateWork of it alone, its rollout rank), until its EvalDone: sent again
        if its rollout or env rank is lost."""
        self.delta_epoch = 0
        """Changes of the rollout ranks so far: the delta channels' epoch (RanksChanged)."""
        self.ranks_lost: list[dict] = list(resume.get("ranks_lost", [])) if resume else []
        """Ranks the live job went on without, this run's and earlier runs' (summary.json)."""
        self.unnamed: list[dict] = []
        """Losses whose one line waits for the cause (the supervisor's report, a moment after MPI's)."""
        self.groups = trainer_group_ranks(job.layout)
        self.lost_groups: set[int] = set()
        self.parting: list = []
        """Sends to the ranks of a lost trainer group that still live (they end themselves on it)."""
        self.delta_order = None
        """With several trainer groups: the job's order of delta broadcasts, hosted here (runtime/delta/broadcast.py)."""
        self.scaler = Scaler(comm, job, self.run_dir, self.log)
        """Rollout ranks joining, draining and wanted (runtime/scaling.py)."""
        self.ranks_joined: list[dict] = list(resume.get("ranks_joined", [])) if resume else []
        self.ranks_left: list[dict] = list(resume.get("ranks_left", [])) if resume else []
        models = list(job.model_names())
        self.rank_models = (RankModels(self.scheduler, models, multi_turn=lambda t: is_multi_turn(self.data[t]))
                            if len(models) > 1 else None)
        """A job of several base models: which model each rollout rank serves (scheduler/rank_models.py)."""

    @property
    def runs(self) -> list[dict]:
        """Earlier runs of this job (each ended by a preemption or a crash), oldest first."""
        return self.books.records.runs

    # ---- intake ----
    def submit(self, spec, resume: dict | None = None, check_code: bool = True) -> list:
        """Admission check of a spec (its data must load); a bad one is refused and never disturbs others.
        check_code: a sandboxed worker loads its reward file first (config tasks; a queued spec's was checked
        by `tasks add`, and one written by hand fails its task at first use: a file that hangs while loading
        must not stall rank 0)."""
        try:
            spec = with_base_model(spec, self.job.model_names())
            check_trained(spec.base_model, self.job.group_models())
            self.data[spec.task_id] = build_task_data(spec.dataset, spec.prompt.format, sandbox=self.job.sandbox)
            self.codecs[spec.task_id] = self._codec_for(spec)
            if check_code:
                check_reward_code(spec.dataset, self.job.sandbox)  # loads in a sandboxed worker, never here
            return self._handle(Submit(spec, resume))
        except (SpecError, ValueError) as exc:
            self._refused(spec.task_id, str(exc))
            self.log(f"[intake] task {spec.task_id!r} refused: {exc}")
            return []

    def _refused(self, key: str, reason: str) -> None:
        """A spec refused: listed in summary.json's 'rejected', and on record (a resume does not take it)."""
        self.rejected[key] = reason
        self.books.records.rejected(key, reason)

    def _codec_for(self, spec):
        """The codec of the spec's prompt format; a chat task on a tokenizer without a template is refused."""
        try:
            return self.model_codecs.get(spec.base_model, self.codec).for_prompt(spec.prompt)
        except ValueError as exc:
            raise SpecError("prompt.format", f"{exc} ({spec.base_model or self.job.model})") from None

    def _handle(self, event) -> list:
        """The scheduler's handling of an event, and what it changes in the run dir (RunBooks.handled: records
        written before any command that depends on them goes out)."""
        commands = self.scheduler.handle(event)
        self.events += 1
        self.books.handled(event, commands)
        return commands

    # ---- loop ----
    def run(self) -> dict:
        """The loop: one start spec submitted (while any is left), one event handled, status.json when due."""
        self.starting = self._start_specs()
        if self.rank_models is not None:
            self._execute(self.rank_models.start())
        while self.starting or not (self.scheduler.finished() and not self.pending_evals) or self._serving():
            if self._preemption_done():
                break
            self.outbox.progress()
            self._poll_queue()
            if self.starting:
                self._submit_next()
            event, source = poll(self.comm, TAG_EVENT)
            if source in self.members.lost and not isinstance(event, RankStats):
                event = None  # a lost rank's last words: what it said is forgotten, or done again elsewhere
            if event is not None:
                with self.busy.track("eval" if isinstance(event, EvalDone) else "event"):
                    self._event(event)
            if self.members.tolerant:
                self._losses()
            self._scale()
            if self.rank_models is not None and self.rank_models.due(time.time()):
                self._plan_models()
            self.books.tick(self.busy)
            self.log.tick(self.scheduler)
            if event is None and not self.starting and not self.taken:
                time.sleep(0.002)
        self._finish_run()
        return self._end()

    def _finish_run(self) -> None:
        """Every worker shut down, its RankStats in (a worker lost meanwhile sends none)."""
        lost = self.members.ended_lost = tuple(sorted(self.members.lost))
        for rank in self.members.alive():
            if rank != 0:
                self.outbox.send(Shutdown(lost=lost), rank, TAG_CMD)
        waiting = set(self._live_workers())  # one per trainer group: its leader
        while waiting:
            event, _ = poll(self.comm, TAG_EVENT)
            if isinstance(event, RankStats):
                self.stats.append(event)
                waiting.discard(event.rank)
            elif event is None:
                time.sleep(0.005)
            waiting -= set(self.members.lost)
        self._name_losses(wait_s=0.0)
        self.outbox.flush()

    def _live_leaders(self) -> list[int]:
        return [leader for group, leader in enumerate(self.leaders) if group not in self.lost_groups]

    def _live_workers(self) -> list[int]:
        """The ranks rank 0 talks to (env, rollout, trainer leaders) that are alive."""
        return [rank for rank in self.members.alive() if rank != 0
                and (self.members.kind_of[rank] != "trainer" or rank in self.leaders)]

    def _end(self) -> dict:
        """The run's outputs, once each: records (one compaction), audit, status.json, summary.json, rank 0's
        timeline."""
        wall = time.time() - self.start
        preempted = self.checkpointed is not None
        earlier = list(self.runs)
        with self.busy.track("end"):
            self.books.close({"started": self.start, "wall_time_s": wall, "startup_s": self.startup_s,
                              "ended": "preempted" if preempted else "finished"}, finished=not preempted)
            if preempted:
                mark_preempted(self.run_dir)
        stages = {stage: {"busy_s": busy, "count": count} for stage, (busy, count) in self.busy.stages.items()}
        mine = RankStats(0, "scheduler", self.busy.busy, wall, {
            "events": self.events, "record_bytes": self.books.records.journal.bytes_written, "stages": stages})
        summary = write_summary(self.run_dir, self.job, self.scheduler, self.evals, self.stats + [mine], wall,
                                self.rejected, self.startup_s, job_start=self.start, runs=earlier,
                                preempted=preempted, ranks_lost=self.ranks_lost,
                                ranks_joined=self.ranks_joined, ranks_left=self.ranks_left)
        write_timeline(self.run_dir, 0, "scheduler", self.busy)
        if preempted:
            versions = {t: max(s.version, 0) for t, s in self.scheduler.tasks.items()}
            self.log(f"[job] preempted: every task checkpointed at {versions}; resume with "
                     f"`marlaas run --resume {self.run_dir}` (under Slurm the job requeues itself)")
        return summary

    # ---- start and preemption ----
    def _start_specs(self) -> deque:
        """What the run starts with, (spec, saved record or None) in submission order. Fresh start: the config's
        tasks. Resume: every checkpointed task at its saved state (the audit and evals so far are taken now),
        then any config task the checkpoint does not know. The loop submits them one at a time between events,
        so that a thousand tasks' v0 adapters, evals and first rollouts flow while the rest are being admitted."""
        from marlaas_hpc.tasks import TaskSpec

        specs: deque = deque()
        if self.resume:
            self.evals = {(e["task_id"], e["when"]): list(e["scores"]) for e in self.resume["evals"]}
            self.rejected.update(self.resume["rejected"])
            saved = self.resume["tasks"]
            specs.extend((TaskSpec.from_dict(entry["spec"]), entry["saved"]) for entry in saved.values())
            self.log(f"[job] resuming (run {len(self.runs) + 1}): " + ", ".join(
                f"{t} {e['saved']['status']} v{e['saved']['version'] or 0}" for t, e in saved.items()))
        known = set(self.resume["tasks"]) if self.resume else set()
        specs.extend((spec, None) for spec in self.job.tasks if spec.task_id not in known)
        return specs

    def _submit_next(self) -> None:
        spec, saved = self.starting.popleft()
        with self.busy.track("admit"):
            self._execute(self.submit(spec, resume=saved))

    def _preemption_done(self) -> bool:
        """Drives the drain once USR2 arrived: True when every task is checkpointed and the job may stop."""
        if not self.preempt.requested:
            return False
        if not self.scheduler.draining:
            self.scheduler.draining = True
            self.log("[job] USR2: draining in-flight work, then checkpointing every task at a step boundary")
        if not self.checkpoint_sent and self.scheduler.settled() and not self.pending_evals:
            for leader in self._live_leaders():  # every trainer group saves the tasks it owns
                self.outbox.send(Checkpoint(), leader, TAG_CMD)
            self.checkpoint_sent = True
        return self.checkpointed is not None

    def _poll_queue(self, force: bool = False) -> None:
        """Takes specs and cancel requests from RUN_DIR/queue (`marlaas tasks add/cancel`), every 0.5 s; the specs
        taken are submitted one per call (one per turn of the loop, between events), and the queue is scanned
        again once they all are (a spec stays pending until it is settled)."""
        if self.scheduler.draining:
            return  # preempted: what is queued stays in the queue dir for the resumed job
        if self.taken:
            with self.busy.track("admit"):
                self._settle_next()
            return
        if not (self.intake.due() or force):
            return
        with self.busy.track("intake"):
            self._take()

    def _settle_next(self) -> None:
        entry, spec, reason = self.taken.popleft()
        if spec is not None:
            self._execute(self.submit(spec, check_code=False))
            reason = None if spec.task_id in self.scheduler.tasks else self.rejected.get(spec.task_id)
        else:
            self._refused_from_queue(entry, reason)
        self.intake.settle(entry, reason, self.scheduler.tasks.get(spec.task_id) if spec else None, self.start)

    def _take(self) -> None:
        self.taken.extend(self.intake.take(self.scheduler.tasks))
        if self.taken:
            self._settle_next()
        cancels = self.intake.cancels(self.scheduler.tasks)
        for task_id, refused in cancels:
            if refused is not None:
                self.log(f"[intake] cancel of {task_id!r} refused: {refused}")
                continue
            if task_id not in self.scheduler.tasks:
                self.log(f"[intake] cancel of unknown task {task_id!r} ignored")
                continue
            self.log(f"[intake] cancel {task_id!r} requested")
            self._execute(self._handle(Cancel(task_id)))

    def _refused_from_queue(self, entry, reason: str) -> None:
        """Listed in summary.json's 'rejected' like a refused config task (by the queue file's name if its task
        id is taken or unreadable)."""
        spec = (entry.data or {}).get("spec")
        task_id = spec.get("task_id") if isinstance(spec, dict) else None
        key = task_id if isinstance(task_id, str) and task_id not in self.scheduler.tasks \
            and task_id not in self.rejected else entry.name
        self._refused(key, reason)
        self.log(f"[intake] {entry.name} refused: {reason}")

    def _serving(self) -> bool:
        """Every task has ended: a serving job (serve_idle_s) waits for more until closed or idle long enough."""
        self._poll_queue()
        if self.taken or not (self.scheduler.finished() and not self.pending_evals) or self.intake.keep_serving():
            return True
        self._poll_queue(force=True)  # a last look: a spec that has just arrived keeps the job up
        return bool(self.taken) or not self.scheduler.finished()

    def _event(self, event) -> None:
        if isinstance(event, EvalDone):
            key = (event.task_id, "before" if event.version is None else "after")
            if event.group_id and self.eval_out.pop(event.group_id, None) is None:
                return  # answered already (sent again after a rank's loss, and both answered)
            if key not in self.pending_evals:
                return  # the task failed meanwhile
            self.evals.setdefault(key, []).append(event.accuracy)
            self.pending_evals[key] -= 1
            if self.pending_evals[key] == 0:
                del self.pending_evals[key]
                scores = self.evals[key]
                self.log(f"[{event.task_id}] eval {key[1]}: greedy accuracy {sum(scores) / len(scores):.3f}")
                self.books.records.eval_done(event.task_id, key[1], scores)
            return
        if isinstance(event, RankStats):
            self.stats.append(event)
            return
        if isinstance(event, WeightsWanted):
            self._weights_wanted(event)
            return
        if isinstance(event, Joining):
            self._joined(event)
            return
        if isinstance(event, CheckpointDone):
            self._checkpoint_done(event)
            return
        if isinstance(event, TaskSaved):
            self.books.task_saved(event.task_id, event.version)
            return
        if isinstance(event, Served):
            self._served(event)
            return
        if isinstance(event, DeltaPlaneFailed):
            self._delta_plane_failed(event)
            return
        if isinstance(event, EngineRestarted):
            self.log(f"[job] rollout rank {event.rank}: engine error ({event.cause}); engine restarted "
                     f"(restart {event.restarts}), {event.requests} requests re-issued")
            return
        commands = self._handle(event)
        if isinstance(event, StepDone) and event.metrics:  # a trained step (not an admission)
            task = self.scheduler.tasks[event.task_id]
            self.log(f"[{event.task_id}] v{event.version}/{task.spec.total_steps} reward "
                     f"{event.metrics.get('reward_mean', 0):.3f} staleness<={event.metrics.get('staleness_max', 0)} "
                     f"(k={task.bound}) loss {event.metrics.get('loss', 0):+.4f}")
        self._execute(commands)

    def _checkpoint_done(self, event: CheckpointDone) -> None:
        # a leader's StepDone events precede its CheckpointDone (same source and tag: MPI keeps their order)
        for task_id, version in event.versions.items():
            ours = self.scheduler.tasks[task_id].version
            if ours != version:
                raise RuntimeError(f"checkpoint of {task_id}: trainer saved v{version}, scheduler is at v{ours}")
            self.books.records.saved(self.scheduler.tasks[task_id])
        self.checkpoints.update(event.versions)
        self.checkpoint_answers += 1
        if self.checkpoint_answers == len(self._live_leaders()):  # every trainer group has saved its tasks
            self.checkpointed = dict(self.checkpoints)

    # ---- commands ----
    def _leader_of(self, task_id: str) -> int:
        """The leader of the trainer group that owns the task now (group 0 before its admission)."""
        return self.leaders[self.scheduler.trainer_group(task_id) or 0]

    def _execute(self, commands: list) -> None:
        for command in commands:
            if isinstance(command, Admit):
                for rank in self.members.alive("env") + [self.leaders[command.trainer_group]]:
                    self.outbox.send(command, rank, TAG_CMD)
                if (command.spec.task_id, "before") not in self.evals:  # a resumed task has its base eval
                    self.base_evals_due.add(command.spec.task_id)
            elif isinstance(command, Generate):
                self.outbox.send(self._work(command), command.rollout_rank, TAG_CMD)
                if command.task_id in self.base_evals_due:  # after the task's first groups, not before
                    self.base_evals_due.discard(command.task_id)
                    self._eval(command.task_id, None)
            elif isinstance(command, Train):
                self.outbox.send(command, self.leaders[command.trainer_group], TAG_CMD)
            elif isinstance(command, Serve):  # before any Generate of its model to the rank (same tag: in order)
                now = time.time()
                self.busy.note("serve", (), now, now, rollout_rank=command.rollout_rank, model=command.model)
                self.outbox.send(command, command.rollout_rank, TAG_CMD)
            elif isinstance(command, Discard):
                self.outbox.send(command, self._leader_of(command.task_id), TAG_CMD)
            elif isinstance(command, Move):  # the old group hands the task over; env ranks send its data anew
                self.log(f"[{command.task_id}] moves from trainer group {command.from_group} to "
                         f"{command.to_group} at v{command.version}")
                for rank in [self.leaders[command.from_group]] + self.members.alive("env"):
                    self.outbox.send(command, rank, TAG_CMD)
            elif isinstance(command, TaskEnded):
                task = self.scheduler.tasks[command.task_id]
                if command.status == "failed":  # its env rank scores nothing more of it, evals included
                    for key in [k for k in self.pending_evals if k[0] == command.task_id]:
                        del self.pending_evals[key]
                    for group_id in [g for g, (work, _) in self.eval_out.items() if work.task_id == command.task_id]:
                        del self.eval_out[group_id]
                self.log(f"[{command.task_id}] {command.status} at v{max(task.version, 0)}"
                         + (f": {command.error}" if command.error else ""))
                if task.version > 0 and command.status != "failed":
                    self._eval(command.task_id, task.version)
                self.outbox.send(command, self._leader_of(command.task_id), TAG_CMD)

    def _work(self, command: Generate) -> GenerateWork:
        data, algo = self.data[command.task_id], self.scheduler.tasks[command.task_id].spec.algo
        codec = self.codecs[command.task_id]
        groups = []
        for gid, index in command.groups:
            sample = data.train_sample(index)
            lengths = data.completion_tokens(sample, algo.group_size)
            groups.append(PromptGroup(gid, index, codec.encode_prompt(first_prompt(data, sample)),
                                      None if lengths is None else [min(n, algo.max_new_tokens) for n in lengths]))
        task = self.scheduler.tasks[command.task_id]
        return GenerateWork(command.task_id, command.version, command.env_rank, groups, algo.group_size,
                            algo.temperature, algo.max_new_tokens, **self._episodes(command.task_id),
                            adapter=task.adapter_key if task.rollbacks else None, model=task.spec.base_model)

    def _episodes(self, task_id: str) -> dict:
        """GenerateWork fields of a multi-turn (tool) task: its rollout rank keeps its groups open."""
        if not is_multi_turn(self.data[task_id]):
            return {}
        return {"multi_turn": True, "episode_tokens": self.scheduler.tasks[task_id].spec.algo.max_episode_tokens}

    def _eval(self, task_id: str, version: int | None) -> None:
        """Greedy accuracy on the eval split: base model (before) or the task's final version (after)."""
        samples = self.data[task_id].eval_samples()
        spec = self.scheduler.tasks[task_id].spec
        rollout, env = self._eval_ranks()
        groups = [PromptGroup(f"{task_id}/eval{s.index}", s.index,
                              self.codecs[task_id].encode_prompt(first_prompt(self.data[task_id], s)))
                  for s in samples]
        self.pending_evals[(task_id, "before" if version is None else "after")] = len(groups)
        task = self.scheduler.tasks[task_id]
        work = GenerateWork(task_id, version, env, groups, 1, 0.0, spec.algo.max_new_tokens, eval=True,
                            **self._episodes(task_id),
                            adapter=task.adapter_key if task.rollbacks and version is not None else None,
                            model=spec.base_model)
        if self.rank_models is not None:  # several models: a rank serving the task's model, or held back
            rollout = self.rank_models.eval_rank(spec.base_model)
            if rollout is None:
                self.rank_models.hold_eval(spec.base_model, work, len(groups))
                return
        self._send_eval(work, rollout)

    def _send_eval(self, work: GenerateWork, rollout: int) -> None:
        self.outbox.send(work, rollout, TAG_CMD)
        for group in work.groups:
            self.eval_out[group.group_id] = (dataclasses.replace(work, groups=[group]), rollout)

    # ---- several base models: rank 0's model pool (scheduler/rank_models.py) ----
    def _plan_models(self) -> None:
        """The model pool's plan: ranks drained, reopened or told to switch (Serve)."""
        with self.busy.track("models"):
            evals = [(work.model, rank) for work, rank in self.eval_out.values()]
            self._execute(self.rank_models.tick(time.time(), evals))

    def _served(self, event: Served) -> None:
        """A rank serves its assigned model now: it is filled, and that model's held-back evals go to it."""
        now = time.time()
        self.busy.note("served", (), now, now, rollout_rank=event.rollout_rank, model=event.model,
                       sleep_s=event.sleep_s, wake_s=event.wake_s)
        commands, evals = self.rank_models.served(event, now)
        self._execute(commands)
        for work in evals:
            if (work.task_id, "before" if work.version is None else "after") in self.pending_evals:
                self._send_eval(work, event.rollout_rank)

    def _eval_ranks(self) -> tuple[int, int]:
        """The next (rollout, env) pair of live ranks for an eval, in turn."""
        rollouts, envs = self.scheduler.rollout_load, self.scheduler.env_load
        rollout = sorted(rollouts)[self._eval_turn % len(rollouts)]
        env = sorted(envs)[self._eval_turn % len(envs)]
        self._eval_turn += 1
        return rollout, env

    # ---- ranks lost (a tolerant job: runtime/membership.py) ----
    def _losses(self) -> None:
        for rank in self.members.take_lost():
            self._rank_lost(rank)
        if self.unnamed:
            self._name_losses()

    def _rank_lost(self, rank: int) -> None:
        """The scheduler's RankLost, the workers' RanksChanged, evals sent again, the record; the line follows
        once the cause is known (`_name_losses`)."""
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
                replaced = self._spawn(f"to replace rank {rank} (layout.rollout_replace)", slot)
            else:
                self.log(f"[scale] rank {rank} is not replaced: {why_not}")
        if not self.members.alive(kind) and replaced is None:
            raise JobCannotGoOn(f"no {kind} rank is left")
        commands = self._handle(RankLost(rank, kind))
        if kind == "rollout":
            self.delta_epoch += 1
            if self.rank_models is not None:
                self.rank_models.lost(rank)
        notice = RanksChanged(self.delta_epoch, tuple(self.members.alive("rollout")), lost=(rank,))
        for worker in self._live_workers():  # before any command that depends on it
            self.outbox.send(notice, worker, TAG_CMD)
        loss = {"rank": rank, "role": kind, "at": time.time(), "cause": None,
                "groups_reissued": [gid for c in commands if isinstance(c, Discard) for gid in c.group_ids],
                "evals_resent": self._resend_evals(rank, kind)}
        self.books.records.rank_lost(loss)
        self.ranks_lost.append(loss)
        self.unnamed.append(loss)
        self._execute(commands)

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
        commands = self._handle(RankLost(rank, "trainer", group, {t: records[t]["saved"] for t in owned}))
        back = {t: [max(version, 0), records[t]["saved"]["version"] or 0] for t, version in owned.items()}
        for task_id, (_, version) in back.items():
            self.books.roll_back(self.scheduler.tasks[task_id], version)
        self.delta_epoch += 1
        notice = RanksChanged(self.delta_epoch, tuple(self.members.alive("rollout")), lost=tuple(self.groups[group]),
                              rolled_back=tuple(back))
        for worker in self._live_workers():
            self.outbox.send(notice, worker, TAG_CMD)
        self.parting.append(self.comm.world.isend(notice, dest=self.leaders[group], tag=TAG_CMD))
        loss = {"rank": rank, "role": f"trainer (group {group})", "trainer_group": group, "at": time.time(),
                "cause": None, "groups_reissued": [g for c in commands if isinstance(c, Discard) for g in c.group_ids],
                "evals_resent": [], "tasks_rolled_back": back}
        self.books.records.rank_lost(loss)
        self.ranks_lost.append(loss)
        self.unnamed.append(loss)
        self.books.status.ranks = self._ranks_view()
        self._execute(commands)

    def _delta_plane_failed(self, event: DeltaPlaneFailed) -> None:
        """A leader's delta plane of an epoch could not be set up (a member lost meanwhile): a new epoch over the live
        rollout ranks, once per epoch (a newer one under way already carries the remake)."""
        self.log(f"[fault] trainer group {event.group}: delta plane of epoch {event.epoch} not set up ({event.why})"
                 + ("" if event.epoch < self.delta_epoch else f"; remade as epoch {self.delta_epoch + 1}"))
        if event.epoch < self.delta_epoch:
            return
        self.delta_epoch += 1
        notice = RanksChanged(self.delta_epoch, tuple(self.members.alive("rollout")))
        for worker in self._live_workers():
            self.outbox.send(notice, worker, TAG_CMD)

    # ---- rollout ranks joining and leaving (runtime/scaling.py) ----
    def _scale(self) -> None:
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
            self._execute(self._handle(RankLeaving(rank)))
            self.log(f"[scale] rollout rank {rank} drains: no new group; it leaves once its groups are done")

    def _spawn(self, why: str, slot: int | None) -> int | None:
        """Starts one rollout rank (in `slot` under Slurm) and says so; None if MPI_Comm_spawn refused it."""
        from mpi4py import MPI

        try:
            rank, host = self.scaler.spawn(slot)
        except MPI.Exception as exc:  # PRRTE found no room on the node, ...: the slot stays free
            where = "" if slot is None else f" in rank {slot}'s slot"
            self.log(f"[scale] could not start a rollout rank {why}".rstrip() + f"{where}: {exc}")
            return None
        where = f" on {host} in rank {slot}'s slot" if host else ""
        self.log(f"[scale] starting rollout rank {rank} {why}".rstrip() + where)
        return rank

    def _drained(self, rank: int) -> bool:
        return self.scheduler.rank_idle(rank) and not any(r == rank for _, r in self.eval_out.values())

    def _leave(self, rank: int) -> None:
        """A drained rollout rank leaves: Shutdown('drained') to it, then it is gone from every communicator."""
        self.scaler.draining.discard(rank)
        self.outbox.send(Shutdown("drained"), rank, TAG_CMD)
        try:
            while True:  # what it says until its RankStats (on a link, what is not received is lost at disconnect)
                event, _ = recv_wait(self.comm, TAG_EVENT, source=rank)
                self._event(event)
                if isinstance(event, RankStats):
                    break
            self.comm.disconnect(rank)  # a joined rank: its link (it disconnects once it has the Shutdown)
        except RankLostError:  # it died meanwhile: idle, it held nothing
            self.comm.links.pop(rank, None)
        self.members.mark_lost(rank)
        self.scaler.release(rank)
        commands = self._handle(RankLost(rank, "rollout"))
        if self.rank_models is not None:
            self.rank_models.lost(rank)
        self.delta_epoch += 1
        notice = RanksChanged(self.delta_epoch, tuple(self.members.alive("rollout")), lost=(rank,), left=(rank,))
        for worker in self._live_workers():
            self.outbox.send(notice, worker, TAG_CMD)
        record = {"rank": rank, "role": "rollout", "at": time.time(), "why": "drained (marlaas scale)"}
        self.books.records.history("rank_left", record)
        self.ranks_left.append(record)
        self.books.status.ranks = self._ranks_view()
        self.log(f"[scale] rollout rank {rank} drained and left; rollout ranks {self.members.alive('rollout')}")
        self._execute(commands)

    def _joined(self, event: Joining) -> None:
        """A started rank's engine is up: it is told who links to it (LinkTo), and opens a port for each. Then
        every worker is told (env ranks and leaders link to it, leaders remake their delta channels with it), and
        the scheduler gives it groups."""
        rank = event.rank
        if event.ports is None:
            self.outbox.send(LinkTo(tuple(self.members.alive("env") + self._live_leaders())), rank, TAG_CMD)
            return
        spawned = self.scaler.joining.get(rank, time.time())
        self.scaler.forget(rank)
        self.members.join(rank, "rollout")
        self.delta_epoch += 1
        notice = RanksChanged(self.delta_epoch, tuple(self.members.alive("rollout")), joined=(rank,),
                              ports={rank: event.ports})
        for worker in self._live_workers():
            self.outbox.send(notice, worker, TAG_CMD)
        record = {"rank": rank, "role": "rollout", "at": time.time(), "start_s": time.time() - spawned}
        self.books.records.history("rank_joined", record)
        self.ranks_joined.append(record)
        self.books.status.ranks = self._ranks_view()
        self.log(f"[scale] rollout rank {rank} joined {record['start_s']:.1f} s after it was started; rollout ranks "
                 f"{self.members.alive('rollout')}")
        if self.rank_models is not None:  # several models: it enters the pool; its Serve goes before its groups
            evals = [(work.model, out) for work, out in self.eval_out.values()]
            self._execute(self.rank_models.joined(rank, time.time(), evals))
        self._execute(self._handle(RankJoined(rank)))

    def _weights_wanted(self, event: WeightsWanted) -> None:
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

    def _ranks_view(self) -> dict:
        """status.json's ranks: the live ones per role, and those that joined."""
        return {"rollout": self.members.alive("rollout"), "env": self.members.alive("env"),
                "joined": [r["rank"] for r in self.ranks_joined], "lost": sorted(self.members.lost)}

    def _resend_evals(self, rank: int, kind: str) -> list[str]:
        """Eval prompts that went to the lost rank and have no answer yet, sent again to live ranks."""
        lost = [(group_id, work) for group_id, (work, rollout) in self.eval_out.items()
                if (rollout if kind == "rollout" else work.env_rank) == rank]
        for group_id, work in lost:
            rollout, env = self._eval_ranks()
            work = dataclasses.replace(work, env_rank=env)
            if self.rank_models is not None:  # several models: to a rank serving its model, or held back
                del self.eval_out[group_id]
                rollout = self.rank_models.eval_rank(work.model)
                if rollout is None:
                    self.rank_models.hold_eval(work.model, work, 1)
                    continue
            self.eval_out[group_id] = (work, rollout)
            self.outbox.send(work, rollout, TAG_CMD)
        return [group_id for group_id, _ in lost]

    LOSS_CAUSE_WAIT_S = 3.0
    """How long a loss's line waits for its cause (the supervisor writes it as the rank's monitor line ends)."""

    def _name_losses(self, wait_s: float | None = None) -> None:
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
            groups, evals = loss["groups_reissued"], loss["evals_resent"]
            shown = ", ".join(groups[:6]) + (", ..." if len(groups) > 6 else "")
            back = loss.get("tasks_rolled_back")
            kind = "trainer" if back is not None else loss["role"]
            went_back = "; tasks back to their checkpoint: " + (", ".join(
                f"{t} v{a} -> v{b}" for t, (a, b) in back.items()) or "none") if back is not None else ""
            self.log(f"[fault] rank {loss['rank']} ({loss['role']}) lost: {loss['cause']}{went_back}; {len(groups)} "
                     f"groups issued again" + (f" ({shown})" if groups else "") + f", {len(evals)} eval prompts sent "
                     f"again; the job goes on with {kind} ranks {self.members.alive(kind)}")
