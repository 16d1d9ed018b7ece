"""Single-process driver: rollout -> reward -> train for one or more tasks, in one Python process.

Used by tests, by the benchmark of the learning core, and as the reference semantics of the distributed
runtime (one on-policy GRPO step per task per round). Multi-turn (tool) tasks play their episodes through
an EpisodeRunner on the same engine (tool tokens masked out of the loss). Outputs follow the run dir layout (rundir.py):
RUN_DIR/tasks/<tenant>/<task_id>/{adapters/v0000,..., metrics.jsonl}.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from marlaas_hpc.env.episode import EpisodeRequest, EpisodeResult, EpisodeRunner, summarize_episodes
from marlaas_hpc.env.kinds import build_task_data
from marlaas_hpc.env.protocol import environment_for, episode_limits, is_multi_turn
from marlaas_hpc.model import TextCodec
from marlaas_hpc.report.tensorboard import TensorBoardSink
from marlaas_hpc.rundir import adapter_dir, task_dir
from marlaas_hpc.rollout import AdapterRef, Generation, GenerationRequest, RolloutEngine
from marlaas_hpc.tasks import Sample, TaskData, TaskSpec
from marlaas_hpc.trajectory import assign_advantages, scored_group
from marlaas_hpc.trajectory import Trajectory


@dataclass
class DriverTask:
    spec: TaskSpec
    data: TaskData
    cursor: int = 0
    """Index of the next training prompt in the task's stream."""
    history: list[dict] = field(default_factory=list)


def to_trajectories(task: DriverTask, samples: list[Sample], gens: list[Generation], codec: TextCodec,
                    group_size: int) -> list[Trajectory]:
    """Scores generations (grouped G per sample, in order) and sets group-relative advantages."""
    trajectories = []
    for i, sample in enumerate(samples):
        group = gens[i * group_size: (i + 1) * group_size]
        rewards = [task.data.reward(sample, codec.decode_completion(g.completion_ids)) for g in group]
        trajectories += scored_group(task.spec.task_id, f"{task.spec.task_id}/{sample.index}", group[0].prompt_ids,
                                     [g.completion_ids for g in group], [g.logprobs for g in group],
                                     group[0].adapter_version, rewards, task.spec.algo.normalize_adv_std)
    return trajectories


class LocalDriver:
    """Holds one rollout engine and one trainer in-process and moves tasks through both."""

    def __init__(self, engine: RolloutEngine, trainer, codec: TextCodec, run_dir: str | Path, seed: int = 0,
                 log=print):
        self.engine, self.trainer, self.codec = engine, trainer, codec
        self.run_dir, self.seed, self.log = Path(run_dir), seed, log
        self.tasks: dict[str, DriverTask] = {}
        self._request_counter = 0
        self.tensorboard = TensorBoardSink()

    def add_task(self, spec: TaskSpec) -> None:
        """Admits a task: loads its data (errors name the field), creates its adapter, publishes v0."""
        data = build_task_data(spec.dataset, spec.prompt.format)
        self.trainer.add_task(spec.task_id, spec.lora, spec.algo)
        self.tasks[spec.task_id] = DriverTask(spec, data)
        task_dir(self.run_dir, spec).mkdir(parents=True, exist_ok=True)
        self._publish(spec.task_id)

    def _codec(self, task_id: str) -> TextCodec:
        """The codec of the task's prompt format (raw or chat)."""
        return self.codec.for_prompt(self.tasks[task_id].spec.prompt)

    def _publish(self, task_id: str) -> None:
        spec = self.tasks[task_id].spec
        version = self.trainer.version(task_id)
        path = adapter_dir(self.run_dir, spec, version)
        self.trainer.export_adapter(task_id, path)
        self.engine.add_adapter(AdapterRef(task_id, version, str(path)))

    def _requests(self, task_id: str, prompts: list[str], copies: int, temperature: float,
                  max_new_tokens: int, version: int | None) -> list[GenerationRequest]:
        requests = []
        for prompt in prompts:
            ids = self._codec(task_id).encode_prompt(prompt)
            for _ in range(copies):
                self._request_counter += 1
                requests.append(GenerationRequest(
                    request_id=f"r{self._request_counter}", task_id=task_id, adapter_version=version,
                    prompt_ids=ids, temperature=temperature, max_new_tokens=max_new_tokens,
                    seed=self.seed * 1_000_003 + self._request_counter))
        return requests

    def rollout(self, task_id: str) -> list[Trajectory]:
        """One batch of B prompts x G samples at the task's current version, scored, with advantages."""
        state = self.tasks[task_id]
        algo = state.spec.algo
        samples = [state.data.train_sample(state.cursor + i) for i in range(algo.batch_prompts)]
        state.cursor += algo.batch_prompts
        if is_multi_turn(state.data):
            results = self.play(task_id, samples, algo.group_size, algo.temperature, self.trainer.version(task_id))
            trajectories = [r.trajectory for r in results]
            assign_advantages(trajectories, algo.normalize_adv_std)
            return trajectories
        requests = self._requests(task_id, [s.prompt for s in samples], algo.group_size, algo.temperature,
                                  algo.max_new_tokens, self.trainer.version(task_id))
        gens = self.engine.generate(requests)
        return to_trajectories(state, samples, gens, self._codec(task_id), algo.group_size)

    def train(self, task_id: str, trajectories: list[Trajectory]) -> dict:
        """One optimizer step of the task; publishes the new version to the rollout engine."""
        start = time.perf_counter()
        metrics = self.trainer.train_step(task_id, trajectories)
        self._publish(task_id)
        state = self.tasks[task_id]
        record = {"task_id": task_id, "version": self.trainer.version(task_id),
                  "reward_mean": sum(t.reward for t in trajectories) / len(trajectories),
                  "train_s": time.perf_counter() - start, "time": time.time(), **metrics}
        state.history.append(record)
        with open(task_dir(self.run_dir, state.spec) / "metrics.jsonl", "a") as sink:
            sink.write(json.dumps(record) + "\n")
        self.tensorboard.write(task_dir(self.run_dir, state.spec), record)
        return record

    def play(self, task_id: str, samples: list[Sample], copies: int, temperature: float,
             version: int | None) -> list[EpisodeResult]:
        """`copies` episodes per sample (group id per sample) of a multi-turn task; an env error raises."""
        state = self.tasks[task_id]
        requests = []
        for sample in samples:
            for _ in range(copies):
                self._request_counter += 1
                requests.append(EpisodeRequest(
                    task_id, f"{task_id}/{sample.index}", sample, environment_for(state.data), version, temperature,
                    state.spec.algo.max_new_tokens, seed=self.seed * 1_000_003 + self._request_counter * 16))
        runner = EpisodeRunner(self.engine, self._codec(task_id), limits=episode_limits(state.spec.algo))
        results = runner.run(requests)
        for result in results:
            if result.error is not None:
                raise result.error
        return results

    def evaluate_episodes(self, task_id: str, use_adapter: bool = True) -> dict[str, float]:
        """Greedy episodes of a multi-turn task on its eval split: accuracy, tool-call rate, finish reasons."""
        state = self.tasks[task_id]
        version = self.trainer.version(task_id) if use_adapter else None
        results = self.play(task_id, state.data.eval_samples(), 1, 0.0, version)
        return {"accuracy": sum(r.reward == 1.0 for r in results) / len(results), **summarize_episodes(results)}

    def evaluate(self, task_id: str, use_adapter: bool = True) -> float:
        """Greedy accuracy on the task's eval split at its current version (or the base model)."""
        state = self.tasks[task_id]
        if is_multi_turn(state.data):
            return self.evaluate_episodes(task_id, use_adapter)["accuracy"]
        samples = state.data.eval_samples()
        version = self.trainer.version(task_id) if use_adapter else None
        requests = self._requests(task_id, [s.prompt for s in samples], 1, 0.0,
                                  state.spec.algo.max_new_tokens, version)
        gens = self.engine.generate(requests)
        codec = self._codec(task_id)
        rewards = [state.data.reward(s, codec.decode_completion(g.completion_ids)) for s, g in zip(samples, gens)]
        return sum(r == 1.0 for r in rewards) / len(rewards)

    def run(self, steps: int | None = None) -> dict[str, dict]:
        """Round-robin: each unfinished task does rollout + one train step per round, until total_steps."""
        before = {tid: self.evaluate(tid) for tid in self.tasks}
        while True:
            pending = [tid for tid, st in self.tasks.items()
                       if self.trainer.version(tid) < (steps or st.spec.total_steps)]
            if not pending:
                break
            for tid in pending:
                record = self.train(tid, self.rollout(tid))
                self.log(f"[{tid}] v{record['version']} reward {record['reward_mean']:.3f} "
                         f"loss {record['loss']:+.4f}")
        after = {tid: self.evaluate(tid) for tid in self.tasks}
        return {tid: {"eval_before": before[tid], "eval_after": after[tid],
                      "version": self.trainer.version(tid)} for tid in self.tasks}
