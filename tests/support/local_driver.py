"""Single-process driver: rollout -> reward -> train for one or more tasks, in one Python process.

Used by tests, by the benchmark of the learning core, and as the reference semantics of the distributed
runtime (one on-policy step of each task's objective per round, dynamic sampling included). Multi-turn (tool) tasks play their episodes through
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
from marlaas_hpc.env.shaping import score_group
from marlaas_hpc.model import TextCodec
from marlaas_hpc.report.tensorboard import TensorBoardSink
from marlaas_hpc.rundir import adapter_dir, task_dir
from marlaas_hpc.rollout import AdapterRef, Generation, GenerationRequest, RolloutEngine
from marlaas_hpc.scheduler.sampling import drops
from marlaas_hpc.tasks import Sample, TaskData, TaskSpec
from marlaas_hpc.trajectory import Trajectory


@dataclass
class DriverTask:
    spec: TaskSpec
    data: TaskData
    cursor: int = 0
    """Index of the next training prompt in the task's stream."""
    history: list[dict] = field(default_factory=list)
    filtered_groups: int = 0
    """Groups dynamic sampling dropped (scheduler/sampling.py, which the driver follows)."""
    uninformative_run: int = 0

    def __post_init__(self):
        self.filters_groups = self.spec.algo.filters_groups
        self.filter_patience = self.spec.algo.dynamic_sampling_patience * self.spec.algo.batch_prompts


def scored_groups(task: DriverTask, samples: list[Sample], gens: list[Generation], codec: TextCodec,
                  group_size: int) -> list[tuple[list[Trajectory], bool]]:
    """Scores generations (grouped G per sample, in order): each group's trajectories with their advantages
    (env/shaping.py), and whether it is informative."""
    groups = []
    for i, sample in enumerate(samples):
        group = gens[i * group_size: (i + 1) * group_size]
        version = group[0].adapter_version if group[0].adapter_version is not None else 0
        trajectories = [Trajectory(task.spec.task_id, f"{task.spec.task_id}/{sample.index}", g.prompt_ids,
                                   g.completion_ids, g.logprobs, version,
                                   reward=task.data.reward(sample, codec.decode_completion(g.completion_ids)))
                        for g in group]
        groups.append((trajectories, score_group(trajectories, task.spec.algo)))
    return groups


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
        self.trainer.add_task(spec.task_id, spec.lora, spec.algo, spec.max_staleness)
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
        """One batch of B prompt groups x G samples at the task's current version, scored, with advantages.
        With dynamic sampling, a group whose rewards are all equal is dropped and another prompt sampled in its
        place, by the scheduler's rule (scheduler/sampling.py)."""
        state = self.tasks[task_id]
        batch = state.spec.algo.batch_prompts
        kept: list[list[Trajectory]] = []
        while len(kept) < batch:
            for group, informative in self._sample_groups(task_id, batch - len(kept)):
                if drops(state, informative):
                    state.filtered_groups += 1
                else:
                    kept.append(group)
        return [traj for group in kept for traj in group]

    def _sample_groups(self, task_id: str, count: int) -> list[tuple[list[Trajectory], bool]]:
        """The next `count` prompts of the task's stream, G samples each, scored: (group, informative)."""
        state = self.tasks[task_id]
        algo = state.spec.algo
        samples = [state.data.train_sample(state.cursor + i) for i in range(count)]
        state.cursor += count
        if is_multi_turn(state.data):
            results = self.play(task_id, samples, algo.group_size, algo.temperature, self.trainer.version(task_id))
            groups: dict[str, list[Trajectory]] = {}
            for result in results:
                groups.setdefault(result.trajectory.group_id, []).append(result.trajectory)
            return [(group, score_group(group, algo, multi_turn=True)) for group in groups.values()]
        requests = self._requests(task_id, [s.prompt for s in samples], algo.group_size, algo.temperature,
                                  algo.max_new_tokens, self.trainer.version(task_id))
        gens = self.engine.generate(requests)
        return scored_groups(state, samples, gens, self._codec(task_id), algo.group_size)

    def train(self, task_id: str, trajectories: list[Trajectory]) -> dict:
        """One optimizer step of the task; publishes the new version to the rollout engine."""
        start = time.perf_counter()
        metrics = self.trainer.train_step(task_id, trajectories)
        self._publish(task_id)
        state = self.tasks[task_id]
        record = {"task_id": task_id, "version": self.trainer.version(task_id),
                  "reward_mean": sum(t.reward for t in trajectories) / len(trajectories),
                  "train_s": time.perf_counter() - start, "time": time.time(), **metrics,
                  "filtered_groups": state.filtered_groups}
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
