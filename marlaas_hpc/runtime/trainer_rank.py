"""Trainer ranks (one trainer group: TP x DP ranks): the leader buffers scored groups from env ranks, runs each
Train order once all its groups are here, re-checks the staleness bound, and publishes the new adapter version: a
PEFT checkpoint in the task's directory and a broadcast to every rollout rank. Other ranks of the group mirror the
leader's calls.

With several trainer groups (layout.trainer_groups) each group owns a set of tasks. A task moves between groups at
a step boundary (scheduler Move): every rank of the old group sends its state shard to the rank at the same
position of the new group (TAG_STATE), the old leader hands over the task's spec and buffered data (Handover,
TAG_HANDOVER) and forwards groups that still reach it; the new leader installs the task on all its ranks, answers
Moved, and only then runs the task's Train orders.

After a task's step the leader asks its CheckpointPolicy whether the task is due for a save; if so every rank of
the group saves the task's shard (a 'save' op; DP replica 0 writes, the replicas hold the same shards), and once every
rank has acknowledged its shard the leader reports the step (TaskSaved, then StepDone). A moving task's save schedule moves with it. An error no task
caused (runtime/faults.py: a peer rank gone, the disk full) is re-raised, never turned into a task failure: the
rank dies, the job stops and resumes from its checkpoints.

After a task's step (and when it ends) the leader deletes the adapter versions the job's retention policy drops
and nothing holds in flight (runtime/retention.py)."""
from __future__ import annotations

import json
import math
import time
from collections import deque
from pathlib import Path

from marlaas_hpc.launch.gpu_share import GpuTurns
from marlaas_hpc.rundir import adapter_dir, task_dir
from marlaas_hpc.report.tensorboard import TensorBoardSink
from marlaas_hpc.runtime.comm import BusyClock, Outbox, drain, recv_wait, write_timeline
from marlaas_hpc.runtime.checkpoint import (CheckpointPolicy, load_torch, prune_shards, rng_state, save_torch,
                                            shard_name, trainer_rng_path, trainer_shard_path)
from marlaas_hpc.runtime.faults import RankLostError, is_job_fault, is_storage_error, storage_error
from marlaas_hpc.runtime.group_guard import RANK, GroupGuard, TaskFault
from marlaas_hpc.runtime.messages import (TAG_CMD, TAG_DATA, TAG_EVENT, TAG_HANDOVER, TAG_STATE, TAG_TRAINER, Admit,
                                          AdmitOp, Checkpoint, CheckpointDone, CheckpointOp, DeltaPlaneFailed, Discard,
                                          ForgetOp, Handover, Move, MoveInOp, MoveOutOp, Moved, PublishOp, RankStats,
                                          RanksChanged, RemoveOp, SaveOp, ScoredGroup, Shutdown, ShutdownOp, StepDone,
                                          TaskEnded, TaskFailed, TaskSaved, Train, TrainOp, TrainerOp)
from marlaas_hpc.runtime.retention import RetentionConfig, in_flight_versions, prune_adapters
from marlaas_hpc.scheduler.staleness import within_bound
from marlaas_hpc.trainer.peft_io import write_peft_adapter


class StalenessViolation(RuntimeError):
    """A Train order carried a sample older than its task's bound: never trained."""


def check_bound(order: Train, trajectories, trainer_version: int) -> None:
    """The trainer's own check of the staleness rule (scheduler/staleness.py) on every sample of an order."""
    if trainer_version != order.from_version:
        raise StalenessViolation(f"{order.task_id}: order for v{order.from_version} but trainer is at "
                                 f"v{trainer_version}")
    for traj in trajectories:
        if not within_bound(traj.behaviour_version, order.from_version, order.bound):
            raise StalenessViolation(f"{order.task_id}: sample of v{traj.behaviour_version} in the step from "
                                     f"v{order.from_version} (bound k={order.bound})")


class TrainerRank:
    def __init__(self, comm, trainer, run_dir: Path, leader: int, followers: list[int], delta_channel=None,
                 groups: list[list[int]] | None = None, group: int = 0, policy: CheckpointPolicy | None = None,
                 retention: RetentionConfig | None = None, turns: GpuTurns | None = None):
        self.comm, self.trainer, self.run_dir = comm, trainer, Path(run_dir)
        self.turns = turns
        """On a GPU an engine may share (layout.share_gpus): each training step in its turn (launch/gpu_share.py)."""
        self.policy = policy
        """Leader only: which task is due for a periodic save after its step (None: only preemption saves)."""
        self.retention = retention
        """Which adapter versions the task dirs keep (the leader prunes them) and whether an ended task's shards
        stay (every rank deletes its own); runtime/retention.py. None: everything stays."""
        self.rank = comm.Get_rank()
        self.leader, self.followers, self.delta = leader, followers, delta_channel
        self.groups = groups or [[leader] + list(followers)]
        """World ranks of every trainer group (launch.layout.trainer_group_ranks); this rank is in `group`."""
        self.group = group
        self.position = self.groups[group].index(self.rank)
        """Place in the group: a moving task's shard goes to the same position of the other group."""
        self.shard = shard_name(trainer.tp_rank, trainer.ep_rank)
        """This rank's share of each task's state (runtime/checkpoint.py): its TP slices, its EP rank's experts."""
        self.moved_to: dict[str, int] = {}
        """Leader only: tasks that moved away -> their new leader (data that still reaches this one is forwarded)."""
        self.ended: set[str] = set()
        self.specs: dict = {}
        self.buffer: dict[str, list] = {}
        self.discarded: set[str] = set()
        self.orders: list[Train] = []
        self.admits: deque[Admit] = deque()
        """Leader only: admissions not run yet. One runs per turn of the loop, between fused steps: a thousand
        tasks admitted together used to hold every ready step back until the last adapter was created."""
        self.clock = BusyClock()
        self.outbox = Outbox(comm)
        self.tensorboard = TensorBoardSink()
        self.adapter_keys: dict[str, str] = {}
        """Task -> the name its versions are published under (Admit.adapter_key: a new one after a rollback)."""
        self.acked = True
        """Whether every follower's acknowledgement of the last durable op said it went through."""
        self.guard = GroupGuard(trainer, clock=self.clock, before_retry=self._before_retry)
        """Every stretch of an op that issues TP/DP collectives ends on every rank of the group together
        (runtime/group_guard.py): redone after one rank's error, or failed alike on all."""

    # ---- every TP rank executes the same ops in the same order ----
    def execute(self, op: TrainerOp):
        return self._OPS[type(op)](self, op)

    def _run_admit(self, op: AdmitOp) -> int:
        return self._admit(op.admit)

    def _run_train(self, op: TrainOp) -> dict:
        """One fused step over several tasks' orders (shared base forward/backward), then each is published: two
        sections the group agrees on, so that a version is published only once every rank has it."""
        for order, trajectories in op.batches:
            check_bound(order, trajectories, self.trainer.version(order.task_id))
        batches = {order.task_id: trajectories for order, trajectories in op.batches}
        metrics = self.guard.run("train", lambda: self._train_in_turn(batches), list(batches))
        self.guard.run("publish", lambda: self._publish_step(metrics))
        return metrics

    def _train_in_turn(self, batches: list) -> dict:
        if self.turns is None:
            return self.trainer.train_steps(batches)
        with self.turns.training_step():  # no engine on this GPU starts, sleeps or wakes meanwhile
            return self.trainer.train_steps(batches)

    def _publish_step(self, metrics: dict[str, dict]) -> None:
        """Publishes each task of a step whose loss is finite; one whose adapter is not is marked diverged."""
        for task_id, task_metrics in metrics.items():
            if math.isfinite(task_metrics.get("loss", 0.0)) and self._publish(task_id) is None:
                task_metrics["diverged"] = "non-finite adapter weights after the step (not published)"

    def _run_save(self, op: SaveOp) -> dict[str, int]:
        return self._save(op.task_ids)

    def _run_checkpoint(self, op: CheckpointOp) -> dict[str, int]:
        return self._checkpoint()

    def _run_remove(self, op: RemoveOp) -> None:
        if op.task_id in self.trainer.tasks:
            # the task ended: groups of it still open are discarded, the final version stays
            self._prune(op.task_id, self.trainer.version(op.task_id), set(), ended=True)
            if self.retention is not None and not self.retention.keep_final_checkpoint:
                # an ended task is never resumed (rank 0 recorded its end before telling this group)
                prune_shards(trainer_shard_path(self.run_dir, self.specs[op.task_id], self.shard, 0).parent,
                             self.shard, None)
            self.trainer.remove_task(op.task_id)
        if self.policy is not None:
            self.policy.forget(op.task_id)

    def _run_forget(self, op: ForgetOp) -> None:
        for task_id in op.task_ids:
            if task_id in self.trainer.tasks:
                self.trainer.remove_task(task_id)
            self.specs.pop(task_id, None)

    def _run_publish(self, op: PublishOp) -> None:
        self.guard.run("publish", lambda: [self._publish(task_id, write=False) for task_id in op.task_ids])

    def _run_move_out(self, op: MoveOutOp) -> None:
        self._send_state(op.task_id, op.target_ranks)

    def _run_move_in(self, op: MoveInOp) -> bool:
        """False: the shard never came (a rank of the old group was lost)."""
        try:
            self._receive_state(op.task_id, op.spec, op.source_ranks)
        except RankLostError:
            return False
        return True

    def _admit(self, admit: Admit) -> int:
        """A new task gets a fresh adapter (v0); a resumed one (or one rolled back after its group's loss) its
        saved shard and optimizer state."""
        spec = admit.spec
        self.specs[spec.task_id] = spec
        self.adapter_keys[spec.task_id] = admit.adapter_key or spec.task_id
        version = self.guard.run("admit", lambda: self._install(admit), [spec.task_id])
        if self.policy is not None:
            self.policy.admitted(spec.task_id, version)
        return version

    def _install(self, admit: Admit) -> int:
        """The task's adapter on this rank, new or from its shard, then published (collective over TP)."""
        spec = admit.spec
        if admit.resume_version is None:
            # shards left by an earlier job in this run dir must not pass for this task's
            prune_shards(trainer_shard_path(self.run_dir, spec, self.shard, 0).parent, self.shard, None)
            self.trainer.add_task(spec.task_id, spec.lora, spec.algo, spec.max_staleness)
        else:
            path = trainer_shard_path(self.run_dir, spec, self.shard, admit.resume_version)
            self.trainer.load_state_dict(spec.task_id, load_torch(path))
            if self.trainer.version(spec.task_id) != admit.resume_version:
                raise RuntimeError(f"{path} holds v{self.trainer.version(spec.task_id)}, the scheduler "
                                   f"resumes v{admit.resume_version}")
        version = self._publish(spec.task_id)
        if version is None:
            raise FloatingPointError(f"adapter of {spec.task_id} v{self.trainer.version(spec.task_id)} has "
                                     "non-finite weights")
        return version

    def _save(self, task_ids: list[str]) -> dict[str, int]:
        """This rank's shard of each task (adapter, optimizer state, version), keeping the newest few. The first DP
        replica of each share writes it (DP ranks below trainer_ep: one per EP rank's experts); the other replicas
        hold the same."""
        versions = {}
        for task_id in task_ids:
            version = versions[task_id] = self.trainer.version(task_id)
            if self.trainer.dp_rank < self.trainer.ep_size:
                path = trainer_shard_path(self.run_dir, self.specs[task_id], self.shard, version)
                save_torch(self.trainer.state_dict(task_id), path)
                prune_shards(path.parent, self.shard, version)
            if self.policy is not None:
                self.policy.saved(task_id, version)
        return versions

    def _checkpoint(self) -> dict[str, int]:
        """Preemption: every TP rank saves its shard of every live task and its random state."""
        versions = self._save(self.trainer.task_ids())
        save_torch(rng_state(), trainer_rng_path(self.run_dir, self.trainer.tp_rank, self.group, self.trainer.dp_rank))
        return versions

    def _publish(self, task_id: str, write: bool = True) -> int | None:
        """Gathers the adapter once (collective over TP); the leader checkpoints it (`write`) and broadcasts it.
        A diverged adapter (inf/NaN weights) is neither written nor sent, and None is returned: on a vLLM
        engine the NaN keys/values its requests write stay in freed KV-cache blocks and turn later requests
        of other tasks to NaN (tests/test_rollout_vllm.py), so it must never reach a rollout rank."""
        import torch

        spec = self.specs[task_id]
        version = self.trainer.version(task_id)
        tensors = self.trainer.adapter_tensors(task_id)
        if not all(torch.isfinite(t).all() for t in tensors.values()):  # same gathered tensors on every TP rank
            return None
        if self.rank == self.leader:
            t0 = time.time()
            out = adapter_dir(self.run_dir, spec, version)
            try:
                if write:
                    write_peft_adapter(out, tensors, spec.lora,
                                       base_model_name_or_path=str(self.trainer.config.model_path))
            except Exception as exc:
                if is_storage_error(exc):  # a full disk is the job's fault: name the file, not the library
                    raise storage_error(exc, f"adapter {out}") from exc
                raise
            self.delta.send(self.adapter_keys.get(task_id, task_id), version, tensors, spec.lora)
            self.clock.note("publish", (task_id,), t0, time.time(), version=version,
                            bytes=sum(t.numel() * 4 for t in tensors.values()))
        return version

    def _everyone(self, op: TrainerOp):
        """The leader runs `op` on every rank of its group. A durable op (SaveOp, CheckpointOp) returns only once
        every follower acknowledged its shard on disk: a TaskSaved (or CheckpointDone) sent while a follower was
        still writing named a shard that a follower killed then never wrote (seen in the fault matrix; the resume
        fell back to the checkpoint before)."""
        for rank in self.followers:
            self.comm.send(op, dest=rank, tag=TAG_TRAINER)
        self.acked = True
        try:
            return self.execute(op)
        finally:
            if op.durable:  # acknowledged whatever happened here: no ack is left for a later op
                for rank in self.followers:  # (stage, whether it went through there)
                    self.acked &= recv_wait(self.comm, TAG_TRAINER, source=rank)[0][1] is not False

    # ---- loops ----
    def run_follower(self) -> None:
        while True:
            op, _ = recv_wait(self.comm, TAG_TRAINER, source=self.leader)
            if isinstance(op, ShutdownOp):
                self.comm.members.ended_lost = op.lost
                write_timeline(self.run_dir, self.rank, "trainer", self.clock)
                self.outbox.flush()
                break
            result = None
            with self.clock.track(op.stage, op.tasks()):
                try:
                    result = self.execute(op)
                except Exception as exc:
                    if is_job_fault(exc):
                        raise
                    # a task's fault: the leader met the same end of the same op (the group agreed on it:
                    # runtime/group_guard.py) and reports it
                if op.durable:  # this rank's shard is written (a job fault above never acks)
                    self.comm.send((op.stage, result), dest=self.leader, tag=TAG_TRAINER)

    def run_leader(self) -> None:
        while True:
            self.outbox.progress()
            # drain everything that arrived during the last step, so that orders ready together fuse
            commands = drain(self.comm, TAG_CMD, source=0)
            shutdown = next((c for c in commands if isinstance(c, Shutdown)), None)
            if shutdown is not None:
                self.comm.members.ended_lost = shutdown.lost
                for rank in self.followers:
                    self.comm.send(ShutdownOp(shutdown.lost), dest=rank, tag=TAG_TRAINER)
                break
            for command in commands:
                self._command(command)
            handovers = drain(self.comm, TAG_HANDOVER)
            for handover in handovers:
                self._move_in(handover)
            data = drain(self.comm, TAG_DATA)
            for scored in data:
                if scored.group_id in self.discarded:
                    self.discarded.discard(scored.group_id)
                elif self.moved_to and (owner := self._owner_elsewhere(scored)) is not None:
                    self.outbox.send(scored, owner, TAG_DATA)
                else:
                    self.buffer[scored.group_id] = scored.trajectories
            admitted = self._admit_next()
            ran = self._run_ready_orders()
            if not commands and not data and not ran and not handovers and not admitted:
                time.sleep(0.002)
        self.delta.close()  # the last versions' broadcasts (or pushes), before this rank leaves
        self.outbox.send(RankStats(self.rank, "trainer", self.clock.busy, self.clock.wall(),
                                   {"trainer_group": self.group, "ranks": self.groups[self.group],
                                    "delta": self.delta.stats(), "regroups": self.guard.regroups}),
                         0, TAG_EVENT)
        self.outbox.flush()
        write_timeline(self.run_dir, self.rank, "trainer", self.clock)
        self.tensorboard.close()

    def _admit_next(self) -> bool:
        if not self.admits:
            return False
        command = self.admits.popleft()
        with self.clock.track("admit", (command.spec.task_id,)):
            try:
                version = self._everyone(AdmitOp(command))
            except Exception as exc:  # e.g. a resumed shard saved at another TP size: this task fails
                if is_job_fault(exc):
                    raise
                self._fail(command.spec.task_id, exc)
                return True
        self.outbox.send(StepDone(command.spec.task_id, version), 0, TAG_EVENT)
        return True

    def _command(self, command) -> None:
        if isinstance(command, Admit):
            self.admits.append(command)
        elif isinstance(command, Checkpoint):
            while self._admit_next():  # every task rank 0 admitted is saved (its Admit came before)
                pass
            with self.clock.track("checkpoint"):
                versions = self._everyone(CheckpointOp())
            self.outbox.send(CheckpointDone(versions), 0, TAG_EVENT)
        elif isinstance(command, Train):
            self.orders.append(command)
        elif isinstance(command, Discard):
            for gid in command.group_ids:
                if self.buffer.pop(gid, None) is None:
                    self.discarded.add(gid)  # its data is still on the way: drop it on arrival
        elif isinstance(command, TaskEnded):
            self.admits = deque(a for a in self.admits if a.spec.task_id != command.task_id)  # cancelled at once
            self.ended.add(command.task_id)
            self.orders = [o for o in self.orders if o.task_id != command.task_id]
            self._everyone(RemoveOp(command.task_id))
        elif isinstance(command, Move):
            self._move_out(command)
        elif isinstance(command, RanksChanged):
            self._ranks_changed(command)

    def _ranks_changed(self, change: RanksChanged) -> None:
        """Ranks lost. This group itself: it ends (rank 0 gave its tasks to another). Another trainer group: the
        tasks it owned are rolled back, and any of them here (handed over from it) is dropped. The delta channel is
        remade among the rollout ranks (blocking until they all joined: runtime/delta/broadcast.py), then every task of this
        group is broadcast again on it."""
        if self.rank in change.lost:
            raise RankLostError(self.rank, "trainer: its trainer group was lost")
        self.comm.apply(change)
        held = [t for t in change.rolled_back if t in self.specs]
        if held:
            self._everyone(ForgetOp(held))
        if change.rolled_back:
            self._drop_tasks(set(change.rolled_back))
        if change.delta_epoch == self.delta.epoch:
            return
        with self.clock.track("remake_channel", rollout_ranks=list(change.rollout_ranks)):
            self.delta.remake(list(change.rollout_ranks), change.delta_epoch)
            if self.delta.broken is not None:  # nothing travels this epoch: rank 0 makes another
                self.outbox.send(DeltaPlaneFailed(self.group, change.delta_epoch, self.delta.broken), 0, TAG_EVENT)
                return
            tasks = sorted(t for t in self.trainer.task_ids() if t in self.specs)
            if tasks:
                self._everyone(PublishOp(tasks))

    def _drop_tasks(self, tasks: set[str]) -> None:
        """What this leader holds of these tasks besides their state: data, orders, admissions, forwarding."""
        for group_id in [g for g, trajs in self.buffer.items() if trajs and trajs[0].task_id in tasks]:
            del self.buffer[group_id]
        self.orders = [o for o in self.orders if o.task_id not in tasks]
        self.admits = deque(a for a in self.admits if a.spec.task_id not in tasks)
        for task_id in tasks:
            self.moved_to.pop(task_id, None)

    def _run_ready_orders(self) -> bool:
        """Runs every order whose groups have all arrived, fused into one step."""
        # a task moving here trains once its state has arrived (Handover)
        ready = [o for o in self.orders if o.task_id in self.specs and all(g in self.buffer for g in o.group_ids)]
        if not ready:
            return False
        taken = {id(o) for o in ready}
        self.orders = [o for o in self.orders if id(o) not in taken]
        batches = []
        for order in ready:
            trajectories = [t for gid in order.group_ids for t in self.buffer.pop(gid)]
            try:
                check_bound(order, trajectories, self.trainer.version(order.task_id))
            except StalenessViolation as exc:  # never trained: the task fails, the others go on
                self._fail(order.task_id, exc)
                continue
            batches.append((order, trajectories))
        if not batches:
            return True
        start = time.time()
        tokens = sum(len(t.completion_ids) + len(t.prompt_ids) for _, trajs in batches for t in trajs)
        with self.clock.track("train", [o.task_id for o, _ in batches], tokens=tokens,
                              samples=sum(len(trajs) for _, trajs in batches)):
            outcomes = self._train(batches)
        train_s = time.time() - start
        trained = [(order, trajs) for order, trajs in batches if not isinstance(outcomes[order.task_id], Exception)]
        for order, _ in batches:
            if isinstance(outcomes[order.task_id], Exception):
                self._fail(order.task_id, outcomes[order.task_id])
        saved = self._save_due([order for order, _ in trained if self._stepped(outcomes[order.task_id])])
        for order, trajectories in trained:
            if order.task_id in saved:
                self.outbox.send(TaskSaved(order.task_id, saved[order.task_id]), 0, TAG_EVENT)
            self._step_done(order, trajectories, outcomes[order.task_id], train_s, len(batches))
        return True

    def _train(self, batches: list) -> dict:
        """Each task's metrics from one fused step, or the error that fails it. A step that raised the same error on
        every rank (TaskFault) left its tasks as they were: it runs again task by task, and only a task whose own
        step raises fails; the tenants fused with it go on."""
        try:
            return self._everyone(TrainOp(batches))
        except Exception as exc:
            if is_job_fault(exc):
                raise
            if not (isinstance(exc, TaskFault) and exc.stage == "train" and len(batches) > 1):
                return {order.task_id: exc for order, _ in batches}
        outcomes = {}
        for batch in batches:
            outcomes.update(self._train([batch]))
        return outcomes

    @staticmethod
    def _stepped(metrics: dict) -> bool:
        """The step produced a new version (finite loss, finite adapter)."""
        return math.isfinite(metrics.get("loss", 0.0)) and "diverged" not in metrics

    def _save_due(self, orders: list[Train]) -> dict[str, int]:
        """Periodic checkpoint of the tasks of this step that are due (not at their last step: an ended task
        is never resumed)."""
        due = [o.task_id for o in orders if self.policy is not None and o.from_version + 1 < self.specs[
            o.task_id].total_steps and self.policy.due(o.task_id, o.from_version + 1)]
        if not due:
            return {}
        with self.clock.track("save", due):
            return self._everyone(SaveOp(due))

    def _fail(self, task_id: str, exc: Exception) -> None:
        reason = exc.reason if isinstance(exc, TaskFault) else f"{type(exc).__name__}: {exc}"
        self.outbox.send(TaskFailed(task_id, f"trainer: {reason}"), 0, TAG_EVENT)

    def _before_retry(self, failure) -> None:
        """Before a failed section runs again: a leader that ran out of memory lets its posted delta broadcasts
        complete, freeing their buffers (up to 16 adapters' worth)."""
        if self.delta is not None and failure is not None and failure.kind == RANK:
            self.delta.flush()

    def _step_done(self, order: Train, trajectories, metrics: dict, train_s: float, fused: int) -> None:
        if not math.isfinite(metrics.get("loss", 0.0)):
            self._fail(order.task_id, FloatingPointError(f"non-finite loss {metrics.get('loss')}"))
            return
        if "diverged" in metrics:
            self._fail(order.task_id, FloatingPointError(metrics["diverged"]))
            return
        version = order.from_version + 1
        record = {**metrics, "version": version, "time": time.time(), "train_s": train_s, "fused_tasks": fused,
                  "reward_mean": sum(t.reward for t in trajectories) / len(trajectories),
                  "staleness_max": max(order.from_version - v for v in order.behaviour_versions),
                  "samples": len(trajectories),
                  # prompt + completion tokens: what the step cost (trainer-group placement weighs tasks by it)
                  "step_tokens": sum(len(t.prompt_ids) + len(t.completion_ids) for t in trajectories)}
        checkpointed = self.policy.last.get(order.task_id, (None,))[0] if self.policy is not None else None
        self._prune(order.task_id, version, in_flight_versions(version, order.from_version, order.in_use_from,
                                                               order.bound, checkpointed))
        with open(task_dir(self.run_dir, self.specs[order.task_id]) / "metrics.jsonl", "a") as sink:
            sink.write(json.dumps(record) + "\n")
        self.tensorboard.write(task_dir(self.run_dir, self.specs[order.task_id]), record)
        self.outbox.send(StepDone(order.task_id, version, record), 0, TAG_EVENT)

    def _prune(self, task_id: str, newest: int, in_flight: set[int], ended: bool = False) -> None:
        """Leader: deletes the task's adapter versions that the retention policy, the task's pins and
        `in_flight` do not keep (a timeline note lists them: what was deleted, and what was in flight then)."""
        if self.retention is None or self.rank != self.leader:
            return
        spec = self.specs[task_id]
        t0 = time.time()
        deleted = prune_adapters(adapter_dir(self.run_dir, spec, 0).parent, self.retention, newest,
                                 spec.keep_versions, in_flight)
        if deleted:
            self.clock.note("prune_adapters", (task_id,), t0, time.time(), newest=newest, deleted=deleted,
                            in_flight=sorted(in_flight), ended=ended)

    # ---- trainer groups: a task moves to another group at a step boundary ----
    def _move_out(self, move: Move) -> None:
        """Leader of the old group: every rank sends its shard and drops the task; the new leader gets the
        spec and the data buffered for the task; later data is forwarded."""
        target = self.groups[move.to_group]
        spec = self.specs[move.task_id]
        with self.clock.track("move_out", (move.task_id,)):
            self._everyone(MoveOutOp(move.task_id, target))
        buffered = {gid: trajs for gid, trajs in self.buffer.items() if trajs and trajs[0].task_id == move.task_id}
        for gid in buffered:
            del self.buffer[gid]
        last_saved = self.policy.hand_over(move.task_id) if self.policy is not None else None
        self.outbox.send(Handover(move.task_id, move.version, spec, self.groups[self.group], buffered, last_saved,
                                  self.adapter_keys.pop(move.task_id, move.task_id)), target[0], TAG_HANDOVER)
        self.moved_to[move.task_id] = target[0]

    def _move_in(self, handover: Handover) -> None:
        """Leader of the new group: every rank receives its shard from its counterpart; then Moved to rank 0.
        A task that ended meanwhile (its TaskEnded came here first) is installed and dropped again, so that
        the shards sent to this group are received."""
        task_id = handover.task_id
        self.moved_to.pop(task_id, None)  # it may come back to a group it left
        if any(rank in self.comm.members.lost for rank in handover.source_ranks):
            return  # its old group was lost: rank 0 rolled the task back (RanksChanged.rolled_back)
        self.adapter_keys[task_id] = handover.adapter_key or task_id
        with self.clock.track("move_in", (task_id,)):
            try:
                arrived = self._everyone(MoveInOp(task_id, handover.spec, handover.source_ranks))
                if not (arrived and self.acked):  # the old group was lost midway: the task was rolled back
                    self._everyone(ForgetOp([task_id]))
                    return
                if self.trainer.version(task_id) != handover.version:
                    raise RuntimeError(f"{task_id}: handed over at v{self.trainer.version(task_id)}, the scheduler "
                                       f"moved it at v{handover.version}")
            except Exception as exc:
                if is_job_fault(exc):
                    raise
                self._fail(task_id, exc)
        if self.policy is not None:  # its periodic saves go on from its last one, not from the move
            self.policy.take_over(task_id, handover.last_saved)
        for gid, trajectories in handover.buffered.items():
            if gid in self.discarded:
                self.discarded.discard(gid)
            else:
                self.buffer[gid] = trajectories
        if task_id in self.ended:
            self._everyone(RemoveOp(task_id))
        self.outbox.send(Moved(task_id, self.group), 0, TAG_EVENT)

    def _owner_elsewhere(self, scored: ScoredGroup) -> int | None:
        """The leader a task moved to, for data of it that reached this (its former) group."""
        return self.moved_to.get(scored.trajectories[0].task_id) if scored.trajectories else None

    def _send_state(self, task_id: str, target_ranks: list[int]) -> None:
        self.outbox.send((task_id, self.trainer.state_dict(task_id)), target_ranks[self.position], TAG_STATE)
        self.trainer.remove_task(task_id)
        self.specs.pop(task_id, None)

    def _receive_state(self, task_id: str, spec, source_ranks: list[int]) -> None:
        (sent, state), _ = recv_wait(self.comm, TAG_STATE, source=source_ranks[self.position])
        if sent != task_id:
            raise RuntimeError(f"expected the state of {task_id} from rank {source_ranks[self.position]}, got {sent}")
        self.trainer.load_state_dict(task_id, state)
        self.specs[task_id] = spec


# trainer op type -> the method every rank of the group runs for it
TrainerRank._OPS = {AdmitOp: TrainerRank._run_admit, TrainOp: TrainerRank._run_train, SaveOp: TrainerRank._run_save,
                    PublishOp: TrainerRank._run_publish, ForgetOp: TrainerRank._run_forget,
                    CheckpointOp: TrainerRank._run_checkpoint, RemoveOp: TrainerRank._run_remove,
                    MoveOutOp: TrainerRank._run_move_out, MoveInOp: TrainerRank._run_move_in}
