"""Greedy evals of each task at rank 0: the base model before training (sent with the task's first Generate, not
at admission: a thousand tasks' evals stood in the rollout queue before any task's first groups) and the final
version after; each prompt is tracked until its EvalDone, and sent again if its rollout or env rank is lost. With
several base models a prompt goes to a rank serving its model, or waits in the model pool (scheduler/rank_models)."""
from __future__ import annotations

import dataclasses

from marlaas_hpc.runtime.messages import TAG_CMD, EvalDone, GenerateWork


class Evals:
    def __init__(self, scheduler, inputs, outbox, records, log, rank_models=None, scores: dict | None = None):
        self.scheduler, self.inputs, self.outbox, self.records, self.log = scheduler, inputs, outbox, records, log
        self.rank_models = rank_models
        self.scores: dict[tuple[str, str], list[float]] = dict(scores or {})
        """(task, 'before' | 'after') -> each prompt's accuracy (a resume's come from its checkpoint)."""
        self.pending: dict[tuple[str, str], int] = {}
        """(task, when) -> prompts not answered yet."""
        self.base_due: set[str] = set()
        """Admitted tasks whose base-model eval goes out with their first Generate."""
        self.out: dict[str, tuple[GenerateWork, int]] = {}
        """Eval prompt group -> (a GenerateWork of it alone, its rollout rank), until its EvalDone: sent again if its
        rollout or env rank is lost."""
        self.turn = 0

    def admitted(self, task_id: str) -> None:
        if (task_id, "before") not in self.scores:  # a resumed task has its base eval
            self.base_due.add(task_id)

    def generated(self, task_id: str) -> None:
        """The task's first Generate went out: its base eval follows it."""
        if task_id in self.base_due:
            self.base_due.discard(task_id)
            self.send(task_id, None)

    def send(self, task_id: str, version: int | None) -> None:
        """Greedy accuracy on the eval split: base model (before) or the task's final version (after)."""
        spec = self.scheduler.tasks[task_id].spec
        rollout, env = self.ranks()
        groups = self.inputs.eval_groups(task_id, version)
        self.pending[(task_id, "before" if version is None else "after")] = len(groups)
        task = self.scheduler.tasks[task_id]
        work = GenerateWork(task_id, version, env, groups, 1, 0.0, spec.algo.max_new_tokens, eval=True,
                            **self.inputs.episodes(task_id),
                            adapter=task.adapter_key if task.rollbacks and version is not None else None,
                            model=spec.base_model)
        if self.rank_models is not None:  # several models: a rank serving the task's model, or held back
            rollout = self.rank_models.eval_rank(spec.base_model)
            if rollout is None:
                self.rank_models.hold_eval(spec.base_model, work, len(groups))
                return
        self.send_work(work, rollout)

    def send_work(self, work: GenerateWork, rollout: int) -> None:
        self.outbox.send(work, rollout, TAG_CMD)
        for group in work.groups:
            self.out[group.group_id] = (dataclasses.replace(work, groups=[group]), rollout)

    def served(self, rollout: int, works: list[GenerateWork]) -> None:
        """A rank serves a model now: that model's held-back evals go to it."""
        for work in works:
            if (work.task_id, "before" if work.version is None else "after") in self.pending:
                self.send_work(work, rollout)

    def done(self, event: EvalDone) -> None:
        key = (event.task_id, "before" if event.version is None else "after")
        if event.group_id and self.out.pop(event.group_id, None) is None:
            return  # answered already (sent again after a rank's loss, and both answered)
        if key not in self.pending:
            return  # the task failed meanwhile
        self.scores.setdefault(key, []).append(event.accuracy)
        self.pending[key] -= 1
        if self.pending[key] == 0:
            del self.pending[key]
            scores = self.scores[key]
            self.log(f"[{event.task_id}] eval {key[1]}: greedy accuracy {sum(scores) / len(scores):.3f}")
            self.records.eval_done(event.task_id, key[1], scores)

    def task_failed(self, task_id: str) -> None:
        """Its env rank scores nothing more of it, evals included."""
        for key in [k for k in self.pending if k[0] == task_id]:
            del self.pending[key]
        for group_id in [g for g, (work, _) in self.out.items() if work.task_id == task_id]:
            del self.out[group_id]

    def on_rank(self, rank: int) -> bool:
        """Whether an eval prompt waits on rollout rank `rank`."""
        return any(r == rank for _, r in self.out.values())

    def in_flight(self) -> list[tuple[str | None, int]]:
        """(model, rollout rank) of each eval prompt out: what the model pool counts as busy."""
        return [(work.model, rank) for work, rank in self.out.values()]

    def ranks(self) -> tuple[int, int]:
        """The next (rollout, env) pair of live ranks for an eval, in turn."""
        rollouts, envs = self.scheduler.rollout_load, self.scheduler.env_load
        rollout = sorted(rollouts)[self.turn % len(rollouts)]
        env = sorted(envs)[self.turn % len(envs)]
        self.turn += 1
        return rollout, env

    def resend(self, rank: int, kind: str) -> list[str]:
        """Eval prompts that went to the lost rank and have no answer yet, sent again to live ranks."""
        lost = [(group_id, work) for group_id, (work, rollout) in self.out.items()
                if (rollout if kind == "rollout" else work.env_rank) == rank]
        for group_id, work in lost:
            rollout, env = self.ranks()
            work = dataclasses.replace(work, env_rank=env)
            if self.rank_models is not None:  # several models: to a rank serving its model, or held back
                del self.out[group_id]
                rollout = self.rank_models.eval_rank(work.model)
                if rollout is None:
                    self.rank_models.hold_eval(work.model, work, 1)
                    continue
            self.out[group_id] = (work, rollout)
            self.outbox.send(work, rollout, TAG_CMD)
        return [group_id for group_id, _ in lost]
