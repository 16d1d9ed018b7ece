"""Env rank (CPU): owns the episodes of the prompt groups routed to it, runs their env steps (tools, verifier)
in an EnvPool, and sends scored trajectories straight to the trainer leader; rank 0 only gets events.

One prompt group = G episodes of one sample (a single-turn task is the one-turn case):

    rank 0 ──GenerateWork(prompt = env.reset text)──► rollout ──GroupTurn(turn 1, G turns)──► env rank
    env rank: env.step(turn text) of every episode, concurrently in the EnvPool (per-call timeout): rewards
              and CPU tools on its workers, steps that wait on a service (lookup) on its I/O lane, hundreds
              at once (bounded per tool by env_pool.tool_concurrency)
        Observation: its tokens are appended to the episode (loss_mask 0, logprob 0) → the episode goes on
        Final, or a limit (max_turns / max_episode_tokens) → the episode ends (truncation reward: 0.0)
    when every step of the turn is back:
        some go on  → ContinueGroup(their contexts) ──► rollout ──GroupTurn(turn t+1, those)──► env rank ...
        all ended   → training rewards and advantages (env/shaping.py) → ScoredGroup ──► trainer leader;
                      Scored (informative: rewards not all equal) ──► rank 0;
                      GroupEnded ──► rollout (unpins the group's version)

Rank 0 builds the first prompt by calling the task env's `reset` (envs reset deterministically); the env
rank resets its own episodes and checks it gets the same prompt. A group moves turn by turn (its episodes'
next turns go out together), which keeps the rollout side simple and batches well; groups of all tasks are
interleaved. Every turn of an episode must come back with the group's version (pinned on the rollout rank):
a turn sampled with any other version is a bug and stops the job. A reward function that raises or returns
NaN / out-of-range, an env that raises or an env step past the pool's timeout fails its task only.

Timeline (timeline/rank<N>.jsonl): 'score' records (a turn of a group arrived -> all its env steps back),
'env_step' records (env steps of >= 1 ms: tool and reward seconds, outcome, io: ran on the I/O lane; the many
faster ones are only in the stats, to keep the file small),
'episode' records of multi-turn groups (turns, per-turn versions, tool calls, model / tool token counts, finish
reason, reward), and for a single-turn group, where every episode is one turn and no tool, one 'episodes' record
(model tokens, finish reasons and rewards of its G episodes: a record per episode was most of local-demo's run dir),
'turn' busy spans of this rank's own book-keeping. RankStats.extra (summary.json 'env_ranks'): the pool's
per-stage latency summaries (tool:<name>, reward, step, queue, step:io, queue:io: p50/p90/p99), the most service
calls in flight at once per tool, and per-task episode figures. The rank's busy fraction is its workers'
occupancy: service waits on the I/O lane hold no worker and do not count.
"""
from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from marlaas_hpc.env.kinds import build_task_data
from marlaas_hpc.env.pool import EnvPool, EnvPoolConfig, StepOutcome
from marlaas_hpc.env.protocol import Environment, Final, environment_for, episode_limits, is_multi_turn
from marlaas_hpc.env.shaping import score_group
from marlaas_hpc.env.tenant_code import SandboxConfig
from marlaas_hpc.model import TextCodec
from marlaas_hpc.runtime.comm import BusyClock, Outbox, poll, write_timeline
from marlaas_hpc.runtime.messages import (TAG_CMD, TAG_DATA, TAG_EVENT, Admit, ContinueGroup, EvalDone, GroupEnded,
                                          GroupTurn, Move, RankStats, RanksChanged, Scored, ScoredGroup, Shutdown,
                                          TaskFailed)
from marlaas_hpc.trajectory import Trajectory


TIMELINE_MIN_STEP_S = 0.001
"""Env steps shorter than this get no timeline record of their own (the pool's stats count them all)."""


@dataclass
class _Episode:
    env: Environment
    completion_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    turn_versions: list[int | None] = field(default_factory=list)
    newest_versions: list[int | None] = field(default_factory=list)
    last_turn_tokens: int = 0
    """Tokens of the latest model turn (the end of completion_ids)."""
    routes: Any = None
    """Routing replay: the recorded experts of every position fed so far (`add_routes`); None: not recorded."""
    tool_calls: int = 0
    tool_errors: int = 0
    final: Final | None = None
    goes_on: bool = False

    def add_routes(self, turn_routes) -> None:
        """A turn's recorded routes: its engine fed the whole context again (prompt, earlier turns, tool output),
        and the positions an earlier turn already recorded keep that turn's, under which its tokens were sampled;
        only the new positions are added (numpy: this rank imports no torch)."""
        if turn_routes is None:
            return
        if self.routes is None:
            self.routes = turn_routes
        else:
            import numpy

            self.routes = numpy.concatenate([self.routes, turn_routes[len(self.routes):]])


@dataclass
class _ScoringGroup:
    first: GroupTurn
    rollout_rank: int
    multi_turn: bool
    episodes: list[_Episode]
    t0: float
    stepping: int = 0
    """Env steps of the current turn still running in the pool."""
    turn: int = 1
    turn_t0: float = 0.0
    """When the current turn's model turns arrived (start of its 'score' timeline span)."""


class EnvRank:
    def __init__(self, comm, codec: TextCodec, trainer_leader: int, run_dir=None,
                 pool_config: EnvPoolConfig = EnvPoolConfig(), sandbox: SandboxConfig | None = None,
                 group_leaders: list[int] | None = None, model_codecs: dict[str, TextCodec] | None = None):
        self.comm, self.codec, self.trainer_leader = comm, codec, trainer_leader
        self.model_codecs = model_codecs or {}
        """Per base model (a job of several): the codec of its tokenizer; a model not here uses `codec`."""
        self.sandbox = sandbox or SandboxConfig()
        """How tenant reward files run here (sandboxed workers; env/tenant_code.py)."""
        self.group_leaders = group_leaders or [trainer_leader]
        """World rank of each trainer group's leader (layout.trainer_groups)."""
        self.trainer_of: dict[str, int] = {}
        """Task -> the leader of the trainer group that owns it (Admit, Move): its scored groups go there."""
        self.run_dir = run_dir
        self.rank = comm.Get_rank()
        self.tasks: dict = {}
        self.specs: dict = {}
        self.codecs: dict[str, TextCodec] = {}
        """Per task: the codec of its prompt format (raw or chat)."""
        self.eval_samples: dict[str, dict[int, object]] = {}
        self.failed: set[str] = set()
        self.early: list[tuple[GroupTurn, int]] = []
        """Data of a task whose Admit has not arrived yet (rank 0 and rollout ranks race)."""
        self.groups: dict[str, _ScoringGroup] = {}
        self.in_pool: dict[Future, tuple[str, int]] = {}
        self.episode_stats: dict[tuple[str, str], dict] = {}
        self.pool = EnvPool(pool_config)
        self.clock = BusyClock()
        self.outbox = Outbox(comm)
        self.lost_rollout: set[int] = set()
        """Rollout ranks lost: their groups were issued again elsewhere, and whatever still comes of them is
        dropped."""

    def run(self) -> None:
        while True:
            self.outbox.progress()
            command, _ = poll(self.comm, TAG_CMD, source=0)
            if isinstance(command, Shutdown):
                self.comm.members.ended_lost = command.lost
                break
            if isinstance(command, Admit):
                self._admit(command)
            elif isinstance(command, Move):  # groups scored from now on go to the new owner (the old one forwards)
                self.trainer_of[command.task_id] = self.group_leaders[command.to_group]
            elif isinstance(command, RanksChanged):
                self._ranks_changed(command)
            data, source = poll(self.comm, TAG_DATA)
            if isinstance(data, GroupTurn) and source not in self.lost_rollout:
                if data.task_id not in self.tasks:
                    self.early.append((data, source))
                else:
                    self._on_turn(data, source)
            stepped = self._collect_steps()
            if command is None and data is None and not stepped:
                time.sleep(0.002)
        self.pool.close()
        extra = {"pool": self.pool.stats(), "episodes": self._episode_summary()}
        self.outbox.send(RankStats(self.rank, "env", self.clock.busy, self.clock.wall(), extra), 0, TAG_EVENT)
        if self.run_dir is not None:
            write_timeline(self.run_dir, self.rank, "env", self.clock)
        self.outbox.flush()

    def _ranks_changed(self, change: RanksChanged) -> None:
        """A rollout rank lost: rank 0 issued its unscored groups again, so what this rank holds of them is
        dropped (no Scored, no ScoredGroup), and what still comes of it is ignored."""
        self.comm.apply(change)
        for rank in change.lost:
            if self.comm.members.kind_of.get(rank) != "rollout":
                continue
            self.lost_rollout.add(rank)
            for group_id in [gid for gid, group in self.groups.items() if group.rollout_rank == rank]:
                del self.groups[group_id]  # its env steps in the pool are dropped as they come back
            self.early = [(data, source) for data, source in self.early if source != rank]

    def _admit(self, command: Admit) -> None:
        spec = command.spec
        self.trainer_of[spec.task_id] = self.group_leaders[command.trainer_group]
        if spec.task_id in self.tasks:  # admitted again after its trainer group was lost: only its owner changed
            return
        self.specs[spec.task_id] = spec
        # rank 0 already checked it loads; a tenant reward file is only read here, it runs in sandboxed workers
        self.tasks[spec.task_id] = task = build_task_data(spec.dataset, spec.prompt.format, sandbox=self.sandbox)
        self.codecs[spec.task_id] = self.model_codecs.get(spec.base_model, self.codec).for_prompt(spec.prompt)
        # rank 0 names an eval prompt by its Sample.index (a file task's line, not its place in the eval split)
        self.eval_samples[spec.task_id] = {sample.index: sample for sample in task.eval_samples()}
        self.pool.add_task(spec.task_id, task)
        ready = [(d, s) for d, s in self.early if d.task_id == spec.task_id]
        self.early = [(d, s) for d, s in self.early if d.task_id != spec.task_id]
        for data, source in ready:
            self._on_turn(data, source)

    # ---- a turn of a group arrives: start its env steps ----
    def _on_turn(self, data: GroupTurn, rollout_rank: int) -> None:
        if data.task_id in self.failed:
            if is_multi_turn(self.tasks[data.task_id]):
                self._drop(data, rollout_rank)
            return
        with self.clock.track("turn", (data.task_id,)):  # no extras: back-to-back spans merge
            group = self.groups.get(data.group_id) if data.turn > 1 else self._open(data, rollout_rank)
            if group is None:
                return
            group.turn_t0 = time.time()
            episodes = data.episodes if data.episodes is not None else range(len(data.completions))
            sampled = data.sampled_versions or [data.version] * len(data.completions)
            routes = data.routes or [None] * len(data.completions)
            for j, ids, logprobs, version, turn_routes in zip(episodes, data.completions, data.logprobs, sampled,
                                                              routes):
                group.episodes[j].add_routes(turn_routes)
                self._add_model_turn(group, j, ids, logprobs, version, data.newest_version)

    def _open(self, data: GroupTurn, rollout_rank: int) -> _ScoringGroup | None:
        task = self.tasks[data.task_id]
        sample = self.eval_samples[data.task_id][data.prompt_index] if data.eval \
            else task.train_sample(data.prompt_index)
        envs = [environment_for(task) for _ in data.completions]
        for env in envs:
            if self.codecs[data.task_id].encode_prompt(env.reset(sample)) != data.prompt_ids:
                self._fail(data.task_id, f"env rank {self.rank}: env reset() gave a different prompt than rank "
                                         "0's (resets must be deterministic)")
                if is_multi_turn(task):
                    self._drop(data, rollout_rank)
                return None
        group = _ScoringGroup(data, rollout_rank, is_multi_turn(task), [_Episode(env) for env in envs], time.time())
        self.groups[data.group_id] = group
        return group

    def _add_model_turn(self, group: _ScoringGroup, j: int, ids: list[int], logprobs: list[float],
                        version: int | None, newest: int | None) -> None:
        first = group.first
        if version != first.version:
            raise RuntimeError(f"{first.group_id} episode {j}: turn sampled with v{version}, but the episode is "
                               f"pinned to v{first.version}")
        episode = group.episodes[j]
        episode.completion_ids += ids
        episode.last_turn_tokens = len(ids)
        episode.logprobs += logprobs
        episode.mask += [1] * len(ids)
        episode.turn_versions.append(version)
        episode.newest_versions.append(newest)
        episode.goes_on = False
        future = self.pool.submit(first.task_id, episode.env, self.codecs[first.task_id].decode_completion(ids))
        self.in_pool[future] = (first.group_id, j)
        group.stepping += 1

    # ---- env steps come back ----
    def _collect_steps(self) -> bool:
        done = [f for f in self.in_pool if f.done()]
        for future in done:
            group_id, j = self.in_pool.pop(future)
            group = self.groups.get(group_id)
            if group is None:  # its task failed meanwhile
                continue
            self._on_step(group, j, future.result())
            group.stepping -= 1
            if group.stepping == 0 and group_id in self.groups:
                self._note_turn_scored(group)
                self._next_turn(group)
        return bool(done)

    def _on_step(self, group: _ScoringGroup, j: int, outcome: StepOutcome) -> None:
        episode, task_id = group.episodes[j], group.first.task_id
        episode.env = outcome.env
        self._note_step(group, j, outcome)
        if not outcome.io:  # worker occupancy, not this thread's; a service wait (I/O lane) holds no worker
            self.clock.busy += outcome.run_s / self.pool.config.workers
        if outcome.error is not None:
            self._fail(task_id, f"env rank {self.rank}: {outcome.error}")
            return
        result = outcome.result
        if isinstance(result, Final):
            episode.final = result
            return
        episode.tool_calls += result.tool_calls
        episode.tool_errors += result.tool_errors
        limits = episode_limits(self.specs[task_id].algo)
        turn = episode.completion_ids[len(episode.completion_ids) - episode.last_turn_tokens:]
        observation = self.codecs[task_id].encode_observation(result.text, turn)
        if len(episode.turn_versions) >= limits.max_turns:
            episode.final = episode.env.truncated("max_turns")
        elif len(group.first.prompt_ids) + len(episode.completion_ids) + len(observation) + 1 \
                > limits.max_total_tokens:
            episode.final = episode.env.truncated("max_tokens")
        else:
            episode.completion_ids += observation
            episode.logprobs += [0.0] * len(observation)
            episode.mask += [0] * len(observation)
            episode.goes_on = True

    def _next_turn(self, group: _ScoringGroup) -> None:
        going_on = [j for j, episode in enumerate(group.episodes) if episode.goes_on]
        if not going_on:
            self._finish(group)
            return
        if not group.multi_turn:
            raise RuntimeError(f"{group.first.group_id}: a single-turn env returned an observation")
        group.turn += 1
        contexts = [group.first.prompt_ids + group.episodes[j].completion_ids for j in going_on]
        self.outbox.send(ContinueGroup(group.first.group_id, group.turn, going_on, contexts), group.rollout_rank,
                         TAG_DATA)

    # ---- a group ends ----
    def _finish(self, group: _ScoringGroup) -> None:
        first = group.first
        del self.groups[first.group_id]
        self._note_episodes(group)
        rewards = [episode.final.reward for episode in group.episodes]
        if group.multi_turn:
            self.outbox.send(GroupEnded(first.group_id), group.rollout_rank, TAG_DATA)
        if first.eval:
            self.outbox.send(EvalDone(first.task_id, first.version, float(rewards[0] == 1.0), 1, first.group_id), 0,
                             TAG_EVENT)
            return
        trajectories = [Trajectory(first.task_id, first.group_id, first.prompt_ids, e.completion_ids, e.logprobs,
                                   first.version if first.version is not None else 0, reward=e.final.reward,
                                   loss_mask=e.mask, routes=e.routes) for e in group.episodes]
        for trajectory in trajectories:
            trajectory.check()
        informative = score_group(trajectories, self.specs[first.task_id].algo, group.multi_turn)
        self.outbox.send(ScoredGroup(first.group_id, trajectories), self.trainer_of[first.task_id], TAG_DATA)
        self.outbox.send(Scored(first.group_id, sum(rewards) / len(rewards), informative), 0, TAG_EVENT)

    def _fail(self, task_id: str, error: str) -> None:
        """Marks a task failed (rank 0 ends it); its open groups are dropped and their versions unpinned."""
        if task_id in self.failed:
            return
        self.failed.add(task_id)
        self.outbox.send(TaskFailed(task_id, error), 0, TAG_EVENT)
        self.pool.cancel_task(task_id)  # its queued steps never run: the other tasks' steps do not wait on them
        for group_id, group in list(self.groups.items()):
            if group.first.task_id == task_id:
                del self.groups[group_id]
                if group.multi_turn:
                    self._drop(group.first, group.rollout_rank)

    def _drop(self, first: GroupTurn, rollout_rank: int) -> None:
        """Ends a multi-turn group of a failed task: the rollout rank unpins it, and frees its slot if a turn
        is still in the engine (a finished turn freed it with its Generated)."""
        self.outbox.send(GroupEnded(first.group_id), rollout_rank, TAG_DATA)

    # ---- measurements ----
    def _note_step(self, group: _ScoringGroup, j: int, outcome: StepOutcome) -> None:
        if outcome.run_s < TIMELINE_MIN_STEP_S:
            return
        result = outcome.result
        kind = "error" if outcome.error is not None else "final" if isinstance(result, Final) else "observation"
        timings = dict(result.timings) if result is not None else {}
        end = time.time()
        self.clock.note("env_step", (group.first.task_id,), end - outcome.run_s, end, group_id=group.first.group_id,
                        episode=j, turn=group.turn, outcome=kind, queued_s=outcome.queued_s, io=outcome.io,
                        **timings)

    def _note_turn_scored(self, group: _ScoringGroup) -> None:
        """A 'score' span: a turn of the group arrived -> all its env steps are back (the simulator's
        calibration reads these as the env stage's time per group)."""
        stepped = sum(len(e.turn_versions) == group.turn for e in group.episodes)
        self.clock.note("score", (group.first.task_id,), group.turn_t0, time.time(), samples=stepped,
                        group_id=group.first.group_id, turn=group.turn, eval=group.first.eval)

    def _note_episodes(self, group: _ScoringGroup) -> None:
        """The group's episodes in the timeline (see the module docstring) and in the per-task episode figures."""
        first, now = group.first, time.time()
        if not group.multi_turn:
            self.clock.note("episodes", (first.task_id,), group.t0, now, group_id=first.group_id, eval=first.eval,
                            prompt_tokens=len(first.prompt_ids), version=first.version,
                            model_tokens=[sum(e.mask) for e in group.episodes],
                            finish=[e.final.reason for e in group.episodes],
                            rewards=[e.final.reward for e in group.episodes])
        for j, episode in enumerate(group.episodes):
            if group.multi_turn:
                self._note_episode(group, j, episode, now)
            self._count_episode(first, episode)

    def _note_episode(self, group: _ScoringGroup, j: int, episode: _Episode, now: float) -> None:
        first = group.first
        model_tokens = sum(episode.mask)
        self.clock.note("episode", (first.task_id,), group.t0, now, group_id=first.group_id, episode=j,
                        eval=first.eval, turns=len(episode.turn_versions), prompt_tokens=len(first.prompt_ids),
                        turn_versions=episode.turn_versions,
                        newest_versions=episode.newest_versions, tool_calls=episode.tool_calls,
                        tool_errors=episode.tool_errors, model_tokens=model_tokens,
                        tool_tokens=len(episode.mask) - model_tokens, finish=episode.final.reason,
                        reward=episode.final.reward)

    def _count_episode(self, first: GroupTurn, episode: _Episode) -> None:
        phase = "train" if not first.eval else "eval_before" if first.version is None else "eval_after"
        stats = self.episode_stats.setdefault((first.task_id, phase), {
            "episodes": 0, "with_tool_call": 0, "turns": 0, "reward": 0.0, "finish": {}})
        stats["episodes"] += 1
        stats["with_tool_call"] += episode.tool_calls > 0
        stats["turns"] += len(episode.turn_versions)
        stats["reward"] += episode.final.reward
        stats["finish"][episode.final.reason] = stats["finish"].get(episode.final.reason, 0) + 1

    def _episode_summary(self) -> dict:
        """task -> phase ('train', 'eval_before', 'eval_after') -> episodes, tool-call rate, mean turns, mean
        reward, finish reasons."""
        summary: dict = {}
        for (task_id, phase), stats in sorted(self.episode_stats.items()):
            n = stats["episodes"]
            summary.setdefault(task_id, {})[phase] = {
                "episodes": n, "tool_call_rate": stats["with_tool_call"] / n, "mean_turns": stats["turns"] / n,
                "mean_reward": stats["reward"] / n, "finish": stats["finish"]}
        return summary
