"""Multi-turn episode runner: rollout <-> env ping-pong for a batch of episodes at once.

    for every episode: prompt = env.reset(sample)                 (tokenised once with TextCodec)
    submit turn 1 of every episode to the RolloutEngine
    loop until every episode is done:
        engine.step() -> finished turns --> EnvPool.submit(env.step(turn text))     (runs concurrently)
        finished env steps: Final            -> episode done, reward
                            Observation      -> append its tokens (loss_mask 0), submit the next turn
                            limit reached    -> episode done, env.truncated(reason) (reward 0.0)

Episodes move independently: one waiting on a slow tool does not hold back the others' generation.
Every turn of an episode samples with the adapter version of its first turn (pinned; `version_of` picks it
when the first turn is submitted). The trajectory's completion is every model token and every observation
token after the prompt; behaviour logprobs are the engine's for model tokens and 0.0 for tool tokens, and
loss_mask is 1 exactly on model tokens. A model turn ends at eos (kept, trained) or at its token cap.

The runner must be the engine's only user while `run` is in progress (it takes every finished Generation).
The runner holds the episode's version between turns with the engine's `pin(task_id, version)` /
`unpin(task_id, version)` (every RolloutEngine has them), so the engine cannot retire it while the env step
runs. The distributed runtime does the same per prompt group (runtime/env_rank.py, runtime/rollout_rank.py).
"""
from __future__ import annotations

import time
import uuid
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from marlaas_hpc.env.pool import EnvPool, EnvPoolConfig, StepOutcome
from marlaas_hpc.env.protocol import Environment, EpisodeLimits, Final
from marlaas_hpc.rollout.base import Generation, GenerationRequest, RolloutEngine
from marlaas_hpc.tasks.base import Sample
from marlaas_hpc.trajectory import Trajectory

if TYPE_CHECKING:  # marlaas_hpc.model imports torch: env workers stay light without it
    from marlaas_hpc.model.codec import TextCodec

FINISH_REASONS = ("answer", "max_turns", "max_tokens", "error")


@dataclass
class EpisodeRequest:
    task_id: str
    group_id: str
    sample: Sample
    env: Environment
    """A fresh episode (`environment_for(task)`); the runner calls reset."""
    adapter_version: int | None = None
    """Version for every turn (None = base model), unless `run(version_of=...)` picks it at the first turn."""
    temperature: float = 1.0
    max_new_tokens: int = 16
    """Token cap of one model turn (further capped by the episode's token budget)."""
    seed: int | None = None
    """Sampling seed of turn 1; turn t uses seed + t - 1."""


@dataclass
class EpisodeResult:
    request: EpisodeRequest
    trajectory: Trajectory | None
    """None when the episode failed (error)."""
    reward: float
    finish: str
    """One of FINISH_REASONS."""
    turns: int
    tool_calls: int
    tool_errors: int
    adapter_version: int | None
    error: Exception | None = None
    """EnvError (a RewardError naming the task) for verifier/env failures; KeyError if the engine refused."""
    transcript: list[tuple[str, str]] = field(default_factory=list)
    """('prompt' | 'model' | 'tool', text) segments, for logs and debugging."""
    env_s: float = 0.0
    """Seconds spent in env steps (tools and reward)."""
    wall_s: float = 0.0


@dataclass
class _Episode:
    index: int
    request: EpisodeRequest
    env: Environment
    prompt_ids: list[int] = field(default_factory=list)
    completion_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    version: int | None = None
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    transcript: list[tuple[str, str]] = field(default_factory=list)
    last_turn: list[int] = field(default_factory=list)
    """Token ids of the latest model turn."""
    env_s: float = 0.0
    started: float = 0.0
    pinned: bool = False

    @property
    def total_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)


class EpisodeRunner:
    def __init__(self, engine: RolloutEngine, codec: TextCodec, pool: EnvPool | None = None,
                 limits: EpisodeLimits = EpisodeLimits(), gather_s: float = 0.005):
        """pool: where env steps run (default: inline, in this thread). gather_s: when the engine is idle and
        an env step finishes, wait this long for more to finish so their next turns share one engine batch
        (matters for a step-per-batch engine like HfEngine; continuous batching does not need it)."""
        self.engine = engine
        self.codec = codec
        self.pool = pool or EnvPool(EnvPoolConfig(mode="inline"))
        self.limits = limits.validate()
        self.gather_s = gather_s
        self._run_id = uuid.uuid4().hex[:8]
        self._request_counter = 0

    def run(self, requests: list[EpisodeRequest],
            version_of: Callable[[str], int | None] | None = None) -> list[EpisodeResult]:
        """Plays every episode to its end; results in request order."""
        episodes = [_Episode(i, req, req.env) for i, req in enumerate(requests)]
        results: dict[int, EpisodeResult] = {}
        in_engine: dict[str, _Episode] = {}
        in_env: dict[Future, _Episode] = {}
        for ep in episodes:
            self.pool.add_task_once(ep.request.task_id, ep.env.task)
            prompt = ep.env.reset(ep.request.sample)
            ep.prompt_ids = self.codec.encode_prompt(prompt)
            ep.transcript.append(("prompt", prompt))
            ep.started = time.monotonic()
            ep.version = version_of(ep.request.task_id) if version_of else ep.request.adapter_version
        ready = list(episodes)
        while ready or in_engine or in_env:
            for ep in ready:
                self._submit_turn(ep, in_engine, results)
            ready = []
            if self.engine.has_unfinished():
                for gen in self.engine.step():
                    ep = in_engine.pop(gen.request_id, None)
                    if ep is not None:
                        in_env[self._on_turn(ep, gen)] = ep
            elif in_env:
                done, _ = wait(list(in_env), return_when=FIRST_COMPLETED)
                if len(done) < len(in_env) and self.gather_s > 0:
                    wait(list(in_env), timeout=self.gather_s)
            elif in_engine:
                raise RuntimeError(f"engine reports no unfinished requests but {len(in_engine)} turns are missing")
            for future in [f for f in in_env if f.done()]:
                ep = in_env.pop(future)
                if self._on_env_step(ep, future.result(), results):
                    ready.append(ep)
        return [results[i] for i in range(len(episodes))]

    # ------------------------------------------------------------ one episode's transitions
    def _submit_turn(self, ep: _Episode, in_engine: dict[str, _Episode], results: dict[int, EpisodeResult]) -> None:
        budget = self.limits.max_total_tokens - ep.total_tokens
        if budget < 1:
            self._done(ep, results, ep.env.truncated("max_tokens"))
            return
        req = ep.request
        self._request_counter += 1
        gen_request = GenerationRequest(
            request_id=f"ep-{self._run_id}-{self._request_counter}", task_id=req.task_id,
            adapter_version=ep.version, prompt_ids=ep.prompt_ids + ep.completion_ids,
            temperature=req.temperature, max_new_tokens=min(req.max_new_tokens, budget),
            seed=None if req.seed is None else req.seed + ep.turns)
        try:
            self.engine.submit([gen_request])
        except (KeyError, ValueError) as exc:
            self._done(ep, results, None, error=exc)
            return
        if not ep.pinned and ep.version is not None and callable(getattr(self.engine, "pin", None)):
            self.engine.pin(req.task_id, ep.version)
            ep.pinned = True
        in_engine[gen_request.request_id] = ep

    def _on_turn(self, ep: _Episode, gen: Generation) -> Future:
        if gen.adapter_version != ep.version or len(gen.logprobs) != len(gen.completion_ids):
            raise RuntimeError(f"engine broke its contract on {gen.request_id}: version {gen.adapter_version} "
                               f"(asked {ep.version}), {len(gen.completion_ids)} ids / {len(gen.logprobs)} logprobs")
        ep.completion_ids += gen.completion_ids
        ep.last_turn = list(gen.completion_ids)
        ep.logprobs += gen.logprobs
        ep.mask += [1] * len(gen.completion_ids)
        ep.turns += 1
        text = self.codec.decode_completion(gen.completion_ids)
        ep.transcript.append(("model", text))
        return self.pool.submit(ep.request.task_id, ep.env, text)

    def _on_env_step(self, ep: _Episode, outcome: StepOutcome, results: dict[int, EpisodeResult]) -> bool:
        """Applies an env step; True if the episode goes on to another turn."""
        ep.env = outcome.env
        ep.env_s += outcome.run_s
        if outcome.error is not None:
            self._done(ep, results, None, error=outcome.error)
            return False
        result = outcome.result
        if isinstance(result, Final):
            self._done(ep, results, result)
            return False
        ep.tool_calls += result.tool_calls
        ep.tool_errors += result.tool_errors
        if ep.turns >= self.limits.max_turns:
            self._done(ep, results, ep.env.truncated("max_turns"))
            return False
        observation_ids = self.codec.encode_observation(result.text, ep.last_turn)
        if ep.total_tokens + len(observation_ids) + 1 > self.limits.max_total_tokens:
            self._done(ep, results, ep.env.truncated("max_tokens"))
            return False
        ep.completion_ids += observation_ids
        ep.logprobs += [0.0] * len(observation_ids)
        ep.mask += [0] * len(observation_ids)
        ep.transcript.append(("tool", result.text))
        return True

    def _done(self, ep: _Episode, results: dict[int, EpisodeResult], final: Final | None,
              error: Exception | None = None) -> None:
        req = ep.request
        if ep.pinned:
            self.engine.unpin(req.task_id, ep.version)
        trajectory = None
        if error is None:
            trajectory = Trajectory(task_id=req.task_id, group_id=req.group_id, prompt_ids=ep.prompt_ids,
                                    completion_ids=ep.completion_ids, behaviour_logprobs=ep.logprobs,
                                    behaviour_version=ep.version if ep.version is not None else 0,
                                    reward=final.reward, loss_mask=ep.mask)
            trajectory.check()
        results[ep.index] = EpisodeResult(
            request=req, trajectory=trajectory, reward=final.reward if final else 0.0,
            finish=final.reason if final else "error", turns=ep.turns, tool_calls=ep.tool_calls,
            tool_errors=ep.tool_errors, adapter_version=ep.version, error=error, transcript=ep.transcript,
            env_s=ep.env_s, wall_s=time.monotonic() - ep.started)


def summarize_episodes(results: list[EpisodeResult]) -> dict[str, float]:
    """Mean reward, tool-call rate (episodes with >= 1 tool call), mean turns, and finish-reason fractions."""
    n = max(len(results), 1)
    summary = {"episodes": len(results), "mean_reward": sum(r.reward for r in results) / n,
               "tool_call_rate": sum(r.tool_calls > 0 for r in results) / n,
               "mean_turns": sum(r.turns for r in results) / n,
               "mean_tool_calls": sum(r.tool_calls for r in results) / n}
    for reason in FINISH_REASONS:
        summary[f"finish_{reason}"] = sum(r.finish == reason for r in results) / n
    return summary
