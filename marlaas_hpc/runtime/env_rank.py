"""Env rank (CPU): scores finished generations with the task's verifier, computes group-relative
advantages and sends the trajectories straight to the trainer leader; rank 0 only gets Scored events."""
from __future__ import annotations

import time

from marlaas_hpc.model import TextCodec
from marlaas_hpc.runtime.comm import BusyClock, Outbox, poll, write_timeline
from marlaas_hpc.runtime.messages import (TAG_CMD, TAG_DATA, TAG_EVENT, EvalDone, GroupData, RankStats,
                                          ScoredGroup, Shutdown)
from marlaas_hpc.scheduler import Admit, Scored, TaskFailed
from marlaas_hpc.tasks import build_task_data
from marlaas_hpc.trainer.grpo import scored_group


class EnvRank:
    def __init__(self, comm, codec: TextCodec, trainer_leader: int, run_dir=None):
        self.comm, self.codec, self.trainer_leader = comm, codec, trainer_leader
        self.run_dir = run_dir
        self.rank = comm.Get_rank()
        self.tasks: dict = {}
        self.specs: dict = {}
        self.failed: set[str] = set()
        self.early: list[GroupData] = []
        """Data of a task whose Admit has not arrived yet (rank 0 and rollout ranks race)."""
        self.clock = BusyClock()
        self.outbox = Outbox(comm)

    def run(self) -> None:
        while True:
            self.outbox.progress()
            command, _ = poll(self.comm, TAG_CMD, source=0)
            if isinstance(command, Shutdown):
                break
            if isinstance(command, Admit):
                self._admit(command)
            data, _ = poll(self.comm, TAG_DATA)
            if isinstance(data, GroupData):
                if data.task_id not in self.tasks:
                    self.early.append(data)
                else:
                    with self.clock.track("score", (data.task_id,), samples=len(data.completions),
                                          eval=data.eval):
                        self._score(data)
            elif command is None:
                time.sleep(0.002)
        self.outbox.send(RankStats(self.rank, "env", self.clock.busy, self.clock.wall()), 0, TAG_EVENT)
        if self.run_dir is not None:
            write_timeline(self.run_dir, self.rank, "env", self.clock)
        self.outbox.flush()

    def _admit(self, command: Admit) -> None:
        spec = command.spec
        self.specs[spec.task_id] = spec
        self.tasks[spec.task_id] = build_task_data(spec.dataset)  # rank 0 already checked it loads
        ready = [d for d in self.early if d.task_id == spec.task_id]
        self.early = [d for d in self.early if d.task_id != spec.task_id]
        for data in ready:
            self._score(data)

    def _score(self, data: GroupData) -> None:
        if data.task_id in self.failed:
            return
        task = self.tasks[data.task_id]
        sample = task.eval_samples()[data.prompt_index] if data.eval else task.train_sample(data.prompt_index)
        try:
            rewards = [task.reward(sample, self.codec.decode_completion(c)) for c in data.completions]
        except Exception as exc:  # RewardError or anything a user's verifier raises
            self.failed.add(data.task_id)
            self.outbox.send(TaskFailed(data.task_id, f"env rank {self.rank}: {exc}"), 0, TAG_EVENT)
            return
        if data.eval:
            self.outbox.send(EvalDone(data.task_id, data.version, float(rewards[0] == 1.0), 1), 0, TAG_EVENT)
            return
        trajectories = scored_group(data.task_id, data.group_id, data.prompt_ids, data.completions, data.logprobs,
                                    data.version, rewards, self.specs[data.task_id].algo.normalize_adv_std)
        self.outbox.send(ScoredGroup(data.group_id, trajectories), self.trainer_leader, TAG_DATA)
        self.outbox.send(Scored(data.group_id, sum(rewards) / len(rewards)), 0, TAG_EVENT)
