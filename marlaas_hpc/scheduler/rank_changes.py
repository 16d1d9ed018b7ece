"""The scheduler's side of ranks that go and come (a rollout or env rank lost, a whole trainer group lost, a rollout
rank draining or joining): a mixin of Scheduler (scheduler/core.py), whose state it changes; rank 0 turns a loss
into RankLost (runtime/rank0/elastic.py), the simulator injects them."""
from __future__ import annotations

import bisect
import heapq
import itertools

from marlaas_hpc.scheduler.events import RankJoined, RankLeaving, RankLost
from marlaas_hpc.scheduler.state import QUEUED, RUNNING, Group, TaskState


class RankChanges:
    """Scheduler's handlers of RankLost, RankLeaving and RankJoined (mixed into Scheduler)."""

    def _on_rank_lost(self, event: RankLost) -> list:
        """The lost rank leaves the pools; every group it held that is not scored yet (generating there, or
        routed to it for scoring) is forgotten and its prompt issued again, to the survivors, at the task's
        version then: nothing of it was trained, so nothing is trained twice. Its old data, wherever it still
        turns up (a trainer leader's buffer), is discarded."""
        rank = event.rank
        if event.role == "trainer":
            return self._trainer_group_lost(event.trainer_group, event.restore)
        if event.role == "rollout" and rank in self.rollout_load:
            del self.rollout_load[rank]
            self._closed_ranks.discard(rank)
            index = self._rank_index[rank]
            at = bisect.bisect_left(self._free_ranks, index)
            if at < len(self._free_ranks) and self._free_ranks[at] == index:
                del self._free_ranks[at]
            held = "rollout_rank"
        elif event.role == "env" and rank in self.env_load:
            del self.env_load[rank]  # its heap entries go stale (_take_env_rank skips them)
            held = "env_rank"
        else:
            return []
        lost = [group for task in self.tasks.values() if task.status == RUNNING
                for group in itertools.chain(task.generating.values(), task.scoring.values())
                if getattr(group, held) == rank]
        return self._reissue(lost, f"{event.role} rank {rank} lost")

    def _reissue(self, groups: list[Group], reason: str) -> list:
        """Forgets these in-flight groups and queues their prompts to be issued again (`_issue` takes them
        first); one Discard per task names them for the trainer leader."""
        by_task: dict[str, list[Group]] = {}
        for group in groups:
            task = self.tasks[group.task_id]
            if task.generating.pop(group.group_id, None) is None:
                del task.scoring[group.group_id]
            self._group_of.pop(group.group_id, None)
            if group.env_rank in self.env_load:  # its Scored, if it still comes, is ignored: free its place now
                self._env_rank_freed(group.env_rank)
            task.reissue.append(group.prompt_index)
            task.reissued_groups += 1
            by_task.setdefault(task.task_id, []).append(group)
        out = []
        for task_id, lost in by_task.items():
            task = self.tasks[task_id]
            task.reissue.sort()  # oldest prompts first
            out.append(self._forget(lost, task, reason))
            self._touch(task)
        return out

    def _trainer_group_lost(self, group: int, restore: dict) -> list:
        """Every task the group owned (or was handing over to another) goes back to its checkpoint, queued to be
        admitted again, on a surviving group; the group is never placed on again."""
        if group in self.trainers.lost:
            return []
        self.trainers.lost.add(group)
        self.trainers.placement.drop_group(group)
        self.trainers.heaps[group].clear()
        self.trainers.ready.discard(group)
        owned = [task for task in self.tasks.values() if task.status == RUNNING
                 and group in (task.trainer_group, self.trainers.moving.get(task.task_id))]
        out = []
        for task in owned:
            out += self._roll_back(task, restore[task.task_id])
        return out

    def _roll_back(self, task: TaskState, saved: dict) -> list:
        """The task as it was at `saved` (its checkpoint), queued for admission (Admit with its resume version).
        Every group issued since is forgotten (Discard), the steps after it leave the audit, and the prompts issued
        since are issued again under fresh ids (their old groups' data may still turn up somewhere)."""
        groups = list(itertools.chain(task.generating.values(), task.scoring.values(), task.ready,
                                      task.training or []))
        for group in itertools.chain(task.generating.values(), task.scoring.values()):
            if group.env_rank in self.env_load:
                self._env_rank_freed(group.env_rank)  # their Scored, if it comes, is ignored
        out = [self._forget(groups, task, f"trainer group {task.trainer_group} lost")] if groups else []
        version = saved["version"] or 0
        self.audit = [r for r in self.audit if r.task_id != task.task_id or r.trained_into <= version]
        if task.training is not None:
            self.training.discard(task.task_id)
        self.trainers.moving.pop(task.task_id, None)
        self._trainable.pop(task.task_id, None)
        self.trainers.placement.release(task.task_id)
        back = TaskState.from_checkpoint(task.spec, saved)
        task.reissue = sorted(set(task.reissue) | set(range(back.next_prompt, task.next_prompt)))
        for name in ("version", "trained_groups", "dropped_groups", "filtered_groups", "max_trained_staleness",
                     "step_times", "reward_history", "resume_version"):
            setattr(task, name, getattr(back, name))
        task.generating, task.scoring, task.ready, task.training = {}, {}, [], None
        task.status, task.trainer_group, task.rollbacks = QUEUED, None, task.rollbacks + 1
        self._n_running -= 1
        key = (-task.spec.priority, task.submitted_at) if self.config.order == "priority" else (task.submitted_at,)
        heapq.heappush(self._queued, (key, self._served[task.task_id], task.task_id))
        self._touch(task)
        return out

    def _on_rank_leaving(self, event: RankLeaving) -> list:
        rank = event.rank
        self.leaving.add(rank)
        if rank in self._rank_index:
            at = bisect.bisect_left(self._free_ranks, self._rank_index[rank])
            if at < len(self._free_ranks) and self._free_ranks[at] == self._rank_index[rank]:
                del self._free_ranks[at]
        return []

    def rank_idle(self, rank: int) -> bool:
        """No group of the rollout rank is generating or being scored (a multi-turn group may need it again)."""
        return self.rollout_load.get(rank, 0) == 0 and not any(
            group.rollout_rank == rank for task in self.tasks.values() if task.status == RUNNING
            for group in itertools.chain(task.generating.values(), task.scoring.values()))

    def _on_rank_joined(self, event: RankJoined) -> list:
        if event.role != "rollout":
            raise ValueError(f"only rollout ranks join a live job, not {event.role!r} rank {event.rank}")
        if event.rank in self._rank_index:
            raise ValueError(f"rollout rank {event.rank} is already known")
        self._rank_index[event.rank] = len(self.rollout_ranks)
        self.rollout_ranks.append(event.rank)
        self.rollout_load[event.rank] = 0
        bisect.insort(self._free_ranks, self._rank_index[event.rank])
        return []
