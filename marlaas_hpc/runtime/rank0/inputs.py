"""What rank 0 knows of each task's inputs: its data (prompts, eval samples) and its prompt codec, and the
GenerateWork a Generate command becomes once the prompts' token ids are filled in."""
from __future__ import annotations

from marlaas_hpc.env import build_task_data
from marlaas_hpc.env.protocol import first_prompt, is_multi_turn
from marlaas_hpc.runtime.messages import GenerateWork, PromptGroup
from marlaas_hpc.scheduler import Generate
from marlaas_hpc.tasks import SpecError


class TaskInputs:
    """Per task: its TaskData and the codec of its prompt format (raw or chat, on its base model's tokenizer)."""

    def __init__(self, job, scheduler, codec, model_codecs: dict | None = None):
        self.job, self.scheduler, self.codec = job, scheduler, codec
        self.model_codecs = model_codecs or {}
        """Per base model (a job of several): the codec of its tokenizer; a model not here uses `codec`."""
        self.data: dict = {}
        self.codecs: dict = {}

    def add(self, spec) -> None:
        """Loads the task's data and picks its codec (a chat task on a tokenizer without a template is refused)."""
        self.data[spec.task_id] = build_task_data(spec.dataset, spec.prompt.format, sandbox=self.job.sandbox)
        try:
            self.codecs[spec.task_id] = self.model_codecs.get(spec.base_model, self.codec).for_prompt(spec.prompt)
        except ValueError as exc:
            raise SpecError("prompt.format", f"{exc} ({spec.base_model or self.job.model})") from None

    def multi_turn(self, task_id: str) -> bool:
        return is_multi_turn(self.data[task_id])

    def work(self, command: Generate) -> GenerateWork:
        data, task = self.data[command.task_id], self.scheduler.tasks[command.task_id]
        algo, codec = task.spec.algo, self.codecs[command.task_id]
        groups = []
        for gid, index in command.groups:
            sample = data.train_sample(index)
            lengths = data.completion_tokens(sample, algo.group_size)
            groups.append(PromptGroup(gid, index, codec.encode_prompt(first_prompt(data, sample)),
                                      None if lengths is None else [min(n, algo.max_new_tokens) for n in lengths]))
        return GenerateWork(command.task_id, command.version, command.env_rank, groups, algo.group_size,
                            algo.temperature, algo.max_new_tokens, **self.episodes(command.task_id),
                            adapter=task.adapter_key if task.rollbacks else None, model=task.spec.base_model,
                            routes=algo.routing_replay)

    def episodes(self, task_id: str) -> dict:
        """GenerateWork fields of a multi-turn (tool) task: its rollout rank keeps its groups open."""
        if not self.multi_turn(task_id):
            return {}
        return {"multi_turn": True, "episode_tokens": self.scheduler.tasks[task_id].spec.algo.max_episode_tokens}

    def eval_groups(self, task_id: str, version: int | None) -> list[PromptGroup]:
        """The task's eval split as prompt groups of one greedy sample each, of the base model (`version` None) or
        of a version. Their ids name which: a task that ends before its base eval is answered has both out at once
        (rank 0 tracks each prompt by its id, and a rollout rank its open groups)."""
        data, codec = self.data[task_id], self.codecs[task_id]
        which = "base" if version is None else f"v{version}"
        return [PromptGroup(f"{task_id}/eval{s.index}-{which}", s.index, codec.encode_prompt(first_prompt(data, s)))
                for s in data.eval_samples()]
