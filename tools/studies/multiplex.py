"""K jobs of different base models on one shared pool of rollout ranks, against dedicated pools (issue #28).

    job j: Simulation (its scheduler, env ranks, trainer groups, its model's workload)  ─┐
                                                                                       ├─ one EventQueue
    pool rank i: one PooledRolloutSim per model, one awake ◄── ModelPool.plan (every tick_s) ─┘
                 (scheduler/multiplex.py: Drain / Reopen / Switch; a switch costs EngineSwitch.seconds)

Each job keeps its own `Simulation` (sim/engine.py) and scheduler, unchanged: the pool only replaces the job's
rollout ranks with its model's engines on the shared ranks and opens / closes those ranks on the job's scheduler
(`Scheduler.open_rollout_rank` / `close_rollout_rank`). A sleeping engine is frozen: it holds no group (the pool
switches a rank only once its model holds nothing there), and the adapter versions published meanwhile are kept
in host memory, their install folded into the wake. Evals are not modelled here (workload `evals: false`).

`run_dedicated` runs each job alone on its own ranks; `run_shared` runs them together on `ranks` pool ranks.
Both report, per job, its end-to-end time and GPUs, and the GPU-hours to finish every task: a job's trainer GPUs
until it ends, its dedicated rollout GPUs until it ends, the shared pool's until the last job ends.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from marlaas_hpc.scheduler import Generate, Submit
from marlaas_hpc.scheduler.multiplex import Drain, ModelDemand, ModelPool, Reopen, Switch
from marlaas_hpc.sim.driver import EventQueue
from marlaas_hpc.sim.engine import RolloutSim, Simulation, TrainerSim
from marlaas_hpc.sim.report import staleness_violations
from marlaas_hpc.sim.setup import SimSetup
from marlaas_hpc.sim.workload import Workload
from marlaas_hpc.tasks.spec import SpecError


@dataclass(kw_only=True, slots=True)
class EngineSwitch:
    """What handing a rollout GPU from one model's engine to another's costs (not measured here: no GPU).

    Defaults from vLLM's sleep-mode figures (blog.vllm.ai 2025-10-26 "Zero-Reload Model Switching with vLLM
    Sleep Mode", and the 2025-10-03 post it follows): level-1 sleep and wake of a small model (Qwen3-0.6B) in
    ~0.1-0.8 s per switch on an A4000, a wake of ~0.1-0.4 s plus a one-token warm-up. An H100's PCIe moves a
    0.6B model's 1.2 GB of bf16 weights in ~50 ms, so these are on the slow side for the simulator's H100 costs.
    """

    sleep: float = 0.2
    """Seconds to put the awake engine to sleep (level 1: weights to host memory, KV cache freed)."""
    wake: float = 0.5
    """Seconds to wake the other engine (weights back, KV cache re-allocated) and warm it up (one token)."""

    @property
    def seconds(self) -> float:
        return self.sleep + self.wake


@dataclass(kw_only=True, slots=True)
class PoolJob:
    """One job of the comparison: one base model, its tasks and layout, its workload (stage costs)."""

    model: str
    """The job's base model (its name in the pool)."""
    setup: SimSetup
    """Layout and tasks; `rollout_ranks` is its dedicated pool (the shared run replaces it)."""
    workload: Workload
    """Its stage costs (a bigger model decodes and trains slower)."""

    def trainer_gpus(self) -> int:
        return self.setup.gpus - self.setup.rollout_ranks


@dataclass
class JobResult:
    model: str
    end_time: float
    """Seconds until its last task ended."""
    gpus: int
    """Its GPUs (dedicated: rollout + trainer; shared: its trainer GPUs, the pool counted apart)."""
    statuses: dict[str, str]
    staleness_violations: int
    rollout_idle_s: float = 0.0
    """Dedicated: GPU-seconds its rollout ranks had nothing to do (no sequence, no install) before it ended."""
    trainer_idle_s: float = 0.0
    """GPU-seconds its trainer GPUs had no step, publish or admission to run before it ended (outside any pool:
    what time-slicing rollout engines cannot take)."""


@dataclass
class PoolResult:
    jobs: list[JobResult]
    pool_ranks: int
    """Shared rollout ranks (0: every job on its own ranks)."""
    gpu_hours: float
    switches: int = 0
    served_s: dict[str, float] = field(default_factory=dict)
    """Shared: GPU-seconds the pool's ranks were awake (or waking) for each model."""
    pool_idle_s: float = 0.0
    """Shared: GPU-seconds the pool's ranks had nothing to do (no sequence, no install, no switch)."""
    reprefill_tokens: int = 0
    """Shared: context tokens prefilled again for sequences whose KV cache a sleep freed in a tool call."""

    @property
    def rollout_idle_s(self) -> float:
        """GPU-seconds of idle rollout ranks: what time-slicing can take at most, switches not counted."""
        return self.pool_idle_s + sum(job.rollout_idle_s for job in self.jobs)

    @property
    def trainer_idle_s(self) -> float:
        return sum(job.trainer_idle_s for job in self.jobs)

    @property
    def gpus(self) -> int:
        return self.pool_ranks + sum(job.gpus for job in self.jobs)


def trainer_idle_s(sim: Simulation, end: float) -> float:
    """GPU-seconds the job's trainer GPUs were idle until `end` (each group's TP x DP GPUs idle together)."""
    gpus = sim.setup.trainer_tp * sim.setup.trainer_dp
    return sum(gpus * (end - min(trainer.meter.busy, end)) for trainer in sim.trainers)


def run_dedicated(jobs: list[PoolJob], seed: int = 0) -> PoolResult:
    """Each job alone on its own rollout ranks (the runs are independent: one simulation each)."""
    results = []
    for index, job in enumerate(jobs):
        sim = Simulation(job.setup, job.workload, seed=seed + index)
        outcome = sim.run()
        idle = sum(outcome.end_time - min(rollout.meter.busy, outcome.end_time) for rollout in sim.rollout.values())
        results.append(JobResult(job.model, outcome.end_time, job.setup.gpus, outcome.ended,
                                 len(staleness_violations(sim)), idle, trainer_idle_s(sim, outcome.end_time)))
    hours = sum(r.gpus * r.end_time for r in results) / 3600
    return PoolResult(results, 0, hours)


def run_colocated(jobs: list[PoolJob], seed: int = 0, switch: EngineSwitch | None = None) -> PoolResult:
    """Each job alone with its trainer on its own rollout GPUs (the runtime's layout.share_gpus), no other
    model: the job-local colocation that `trainers_in_pool` also does, without the time-slicing across models.
    A job's GPUs are its rollout ranks, counted until it ends."""
    results = []
    for index, job in enumerate(jobs):
        alone = run_shared([job], job.setup.rollout_ranks, switch, seed + index, trainers_in_pool=True)
        result = alone.jobs[0]
        result.gpus, result.rollout_idle_s = alone.pool_ranks, alone.pool_idle_s
        results.append(result)
    return PoolResult(results, 0, sum(r.gpus * r.end_time for r in results) / 3600)


def run_shared(jobs: list[PoolJob], ranks: int, switch: EngineSwitch | None = None, seed: int = 0,
               tick_s: float = 0.05, horizon_s: float = 1e6, fill_gaps: bool = False,
               release: bool = False, trainers_in_pool: bool = False) -> PoolResult:
    """Every job on one pool of `ranks` rollout ranks, time-sliced by the ModelPool (`tick_s`: how often the
    pool plans; a job not done by `horizon_s` simulated seconds is reported unfinished, at that time;
    `fill_gaps`: the pool also switches ranks whose model's groups all wait on tool calls; `release`: when a
    job ends the pool gives back the ranks the remaining jobs would not have had alone, `ModelPool.release`,
    and a released rank's GPU counts only until then; `trainers_in_pool`: every job's trainer ranks run on the
    pool's GPUs too, one trainer rank per GPU from the front, as layout.share_gpus places them, and no trainer
    GPU is counted apart: `PooledTrainerSim`)."""
    pool = SharedPool(jobs, ranks, switch or EngineSwitch(), seed, tick_s, fill_gaps, release, trainers_in_pool)
    pool.run(horizon_s)
    results, held, hours = pooled_results(jobs, pool.sims, pool.released_at, ranks, horizon_s, trainers_in_pool)
    makespan = max(r.end_time for r in results)
    busy = sum(min(engine.meter.busy, held[rank]) for rank, engines in enumerate(pool.engines)
               for engine in engines.values())
    return PoolResult(results, ranks, hours, pool.policy.switches, pool.served_s(makespan),
                      max(0.0, sum(held) - busy),
                      sum(engine.reprefill_tokens for engines in pool.engines for engine in engines.values()))


def pooled_results(jobs: list[PoolJob], sims: list[Simulation], released_at: dict[int, float], ranks: int,
                   horizon_s: float, trainers_in_pool: bool) -> tuple[list[JobResult], list[float], float]:
    """Each job's result on a shared pool, each pool rank's held seconds (until the last job ends or the rank was
    given back) and the GPU-hours: the pool's held GPUs plus each job's trainer GPUs outside it until it ends."""
    results = []
    for job, sim in zip(jobs, sims):
        end = horizon_s if sim.end_time is None else sim.end_time
        results.append(JobResult(job.model, end, 0 if trainers_in_pool else job.trainer_gpus(),
                                 {t: s.status for t, s in sim.scheduler.tasks.items()},
                                 len(staleness_violations(sim)),
                                 trainer_idle_s=0.0 if trainers_in_pool else trainer_idle_s(sim, end)))
    makespan = max(r.end_time for r in results)
    held = [min(makespan, released_at.get(rank, makespan)) for rank in range(ranks)]
    return results, held, (sum(held) + sum(r.gpus * r.end_time for r in results)) / 3600


class PooledSimulation(Simulation):
    """One job of a shared pool: a Generate counts on its rank's engine from the moment it is issued (it is in
    flight for a message latency), so the pool never puts an engine to sleep with groups on their way to it."""

    def _execute(self, command) -> None:
        if isinstance(command, Generate):
            self.rollout[command.rollout_rank].held += len(command.groups)
        super()._execute(command)

    def execute(self, commands: list) -> None:
        """Commands a scheduler gave outside an event (a rank opened to it)."""
        for command in commands:
            self._execute(command)


class PooledTrainerSim(TrainerSim):
    """One trainer group whose ranks run on pool GPUs (`trainers_in_pool`; the runtime's layout.share_gpus puts a
    trainer rank and rollout engines on one GPU). Its GPU work (an admission, a step's compute) takes each of its
    GPUs whole, after what holds it already (a wake, an install, a step): the engine awake there pauses for it.
    The runtime's two processes share the GPU concurrently instead; pausing the engine is the costlier side of
    that, and no memory is modelled (two 0.6B models' engines and trainers fit one H100's 80 GB many times)."""

    def __init__(self, sim: Simulation, index: int, pool: "SharedPool", gpus: tuple[int, ...]):
        super().__init__(sim, index)
        self.pool, self.gpus = pool, gpus
        """The pool ranks its TP x DP ranks run on."""

    def _on_gpu(self, seconds: float, stage: str) -> float:
        return max(self.pool.occupy(rank, seconds, stage) for rank in self.gpus)


class PooledRolloutSim(RolloutSim):
    """One model's engine on a shared rollout rank: awake or asleep (frozen), and what the pool needs to know:
    the groups it holds, those with a sequence in the engine, and how long each held the rank.

    An engine may sleep while groups of it wait on tool calls (the pool's `fill_gaps`): their KV caches are
    freed with the sleep, so each of those sequences, when its tool call returns, waits for the engine to wake
    (parked: `ready_groups`) and is prefilled again, its whole context so far (the group's tokens over its
    sequences), before its next turn; `reprefill_tokens` counts that extra prefill."""

    def __init__(self, sim: Simulation, rank: int, on_group_done):
        super().__init__(sim, rank)
        self.asleep = False
        self.held = 0
        """Groups issued to this engine and not yet generated: on their way, waiting for their version,
        decoding, or in a tool call between turns."""
        self._arrived: dict[str, float] = {}
        self._groups: dict[str, object] = {}
        """Arrived groups not generated yet, by id."""
        self._size: dict[str, int] = {}
        """Sequences of each arrived group (its context is shared out over them for a re-prefill)."""
        self._in_tools: set = set()
        """Sequences in a tool call now."""
        self._evicted: set = set()
        """Sequences whose KV cache a sleep freed while they were in a tool call."""
        self._parked: list = []
        """(sequence, tool tokens) back from a tool call while the engine sleeps."""
        self.reprefill_tokens = 0
        self._on_group_done = on_group_done

    def receive(self, group, asked) -> None:
        if not group.eval and group.group_id not in self._arrived:
            self._arrived[group.group_id] = self.sim.queue.now
            self._groups[group.group_id] = group
            self._size[group.group_id] = group.sequences_left
        super().receive(group, asked)

    def engine_groups(self) -> int:
        """Held groups with a sequence in the engine or on their way (not every sequence in a tool call)."""
        waiting = {id(group) for group, _ in self.waiting}
        tooling = sum(1 for group in self._groups.values() if group.in_engine == 0 and id(group) not in waiting)
        return self.held - tooling

    def ready_groups(self) -> int:
        """Groups with a parked sequence back from its tool call, waiting for this engine to wake."""
        return len({id(sequence.group) for sequence, _ in self._parked})

    def _turn_done(self, sequence) -> None:
        super()._turn_done(sequence)
        group = sequence.group
        if sequence.turns_left > 0:
            self._in_tools.add(sequence)
        if group.sequences_left == 0 and group.group_id in self._arrived:
            self.held -= 1
            del self._groups[group.group_id], self._size[group.group_id]
            self._on_group_done(self.sim.queue.now - self._arrived.pop(group.group_id))

    def _tool_returns(self, sequence, tool_tokens: int) -> None:
        if self.dead:
            return
        self._in_tools.discard(sequence)
        if self.asleep:
            self._parked.append((sequence, tool_tokens))
            return
        if sequence in self._evicted:  # its KV cache went with a sleep: prefill its context again
            self._evicted.discard(sequence)
            group = sequence.group
            context = round(group.tokens / max(1, self._size.get(group.group_id, 1)))
            self.reprefill_tokens += context
            self._prefill(context)
        super()._tool_returns(sequence, tool_tokens)

    def pause(self, seconds: float, stage: str) -> float:
        """The GPU runs something else (a pooled trainer's step) for `seconds` once it is free: decoding waits.
        Returns when the GPU is free again."""
        self._stall(seconds, stage)
        return self.stall_until

    def sleep(self) -> None:
        if self.engine_groups() or self.running or self.queue:
            raise RuntimeError(f"rollout rank {self.rank}: an engine with {self.engine_groups()} groups in it was put "
                               f"to sleep")
        self._advance()
        self._evicted |= self._in_tools
        self.asleep, self.stall_until = True, math.inf  # frozen: no decoding, no wake-up, installs are free

    def wake(self, seconds: float) -> None:
        now = self.sim.queue.now
        self.asleep, self.stall_until, self.last = False, now, now
        self._stall(seconds, "wake")
        parked, self._parked = self._parked, []
        for sequence, tool_tokens in parked:
            self._tool_returns(sequence, tool_tokens)


def trainer_placement(jobs: list[PoolJob], ranks: int) -> dict[str, list[tuple[int, ...]]]:
    """Trainers in the pool: every job's trainer groups, in job order, take the pool's GPUs from the front, one
    trainer rank (TP x DP of a group) per GPU, as layout.share_gpus places trainer ranks beside the engines; two
    trainer ranks never share a GPU (devices.py keeps them distinct). SpecError when the pool is too small."""
    placement, front = {}, 0
    for job in jobs:
        size = job.setup.trainer_tp * job.setup.trainer_dp
        placement[job.model] = [tuple(range(front + g * size, front + (g + 1) * size))
                                for g in range(job.setup.trainer_groups)]
        front += size * job.setup.trainer_groups
    if front > ranks:
        raise SpecError("ranks", f"trainers in the pool need one GPU per trainer rank, {front} here; the pool has "
                                 f"{ranks}")
    return placement


class SharedPool:
    """The driver: K job simulations on one event queue, their rollout ranks replaced by the pool's engines."""

    def __init__(self, jobs: list[PoolJob], ranks: int, switch: EngineSwitch, seed: int, tick_s: float,
                 fill_gaps: bool = False, release: bool = False, trainers_in_pool: bool = False):
        models = [job.model for job in jobs]
        if len(set(models)) != len(models):
            raise SpecError("jobs", f"each job of a shared pool needs its own model, got {models}")
        for job in jobs:
            if job.workload.evals:
                raise SpecError(f"{job.model}.workload.evals", "evals are not modelled on a shared pool: set false")
        self.queue = EventQueue()
        self.switch, self.tick_s = switch, tick_s
        self.models = models
        self.sims: list[PooledSimulation] = []
        self.engines: list[dict[str, PooledRolloutSim]] = [{} for _ in range(ranks)]
        """Per pool rank: each model's engine."""
        self.trainer_gpus = trainer_placement(jobs, ranks) if trainers_in_pool else {}
        """trainers_in_pool: per model, the pool ranks of each of its trainer groups."""
        self.gpu_free_at = [0.0] * ranks
        """Per pool rank: when the pooled trainer work given to it so far ends (a switch waits for it)."""
        self.world: dict[str, tuple[int, ...]] = {}
        """Per model: the world rank of each pool rank in its job's numbering."""
        slots = {job.setup.rollout_slots for job in jobs}
        # each job weighs what it would have had alone: its dedicated rollout ranks
        self.policy = ModelPool(ranks, models, switch.seconds, max(slots),
                                weights={job.model: float(job.setup.rollout_ranks) for job in jobs},
                                fill_gaps=fill_gaps)
        for index, job in enumerate(jobs):
            self.sims.append(self._job(job, ranks, seed + index))
            if trainers_in_pool:
                sim = self.sims[-1]
                sim.trainers = [PooledTrainerSim(sim, i, self, gpus) for i, gpus in
                                enumerate(self.trainer_gpus[job.model])]
        self.release = release
        self.released_at: dict[int, float] = {}
        """Pool rank -> when it was given back (`release`)."""
        self._ended: set[str] = set()
        self._awake_since = [0.0] * ranks
        self._served = {model: 0.0 for model in models}

    def _job(self, job: PoolJob, ranks: int, seed: int) -> PooledSimulation:
        sim = PooledSimulation(dataclasses.replace(job.setup, rollout_ranks=ranks), job.workload, seed=seed)
        sim.queue = self.queue  # one clock for every job (the scheduler reads sim.queue.now)
        world = self.world[job.model] = sim.setup.world_ranks()["rollout"]
        sim.rollout = {}
        for index, rank in enumerate(world):
            engine = PooledRolloutSim(sim, rank, lambda seconds, model=job.model: self.policy.observe(model, seconds))
            self.engines[index][job.model] = sim.rollout[rank] = engine
            if self.policy.ranks[index].awake != job.model:
                engine.sleep()
                sim.scheduler.close_rollout_rank(rank)
        return sim

    def run(self, horizon_s: float) -> None:
        for sim in self.sims:
            for spec in sim.setup.tasks:
                self.queue.at(0.0, sim.scheduler_event, Submit(spec))
        self.queue.at(0.0, self._tick)  # the tick keeps the queue alive: the horizon ends a job that hangs
        self.queue.run(until_idle=lambda: self.queue.now > horizon_s
                       or all(sim.end_time is not None for sim in self.sims))

    def _tick(self) -> None:
        if self.release:
            for model, sim in zip(self.models, self.sims):
                if sim.end_time is not None and model not in self._ended:
                    self._ended.add(model)
                    for rank in self.policy.release(model, pinned=self._live_trainer_gpus()):
                        self.released_at[rank] = self.queue.now
        demand = {model: ModelDemand(sim.scheduler.pending_rollout(),
                                     {i: engines[model].held for i, engines in enumerate(self.engines)},
                                     {i: engines[model].engine_groups() for i, engines in enumerate(self.engines)},
                                     {i: engines[model].ready_groups() for i, engines in enumerate(self.engines)})
                  for model, sim in zip(self.models, self.sims)}
        for command in self.policy.plan(self.queue.now, demand):
            self._apply(command)
        self.queue.after(self.tick_s, self._tick)

    def _apply(self, command) -> None:
        if isinstance(command, Drain):
            self._sim(command.model).scheduler.close_rollout_rank(self.world[command.model][command.rank])
        elif isinstance(command, Reopen):
            self._open(command.rank, command.model)
        elif isinstance(command, Switch):
            now = self.queue.now
            self._served[command.from_model] += now - self._awake_since[command.rank]
            self._awake_since[command.rank] = now
            self._sim(command.from_model).scheduler.close_rollout_rank(self.world[command.from_model][command.rank])
            self.engines[command.rank][command.from_model].sleep()
            held = max(0.0, self.gpu_free_at[command.rank] - now)  # a pooled trainer's step runs there first
            self.engines[command.rank][command.to_model].wake(self.switch.seconds + held)
            self.queue.at(command.ready_at, self._woken, command)

    def _woken(self, command: Switch) -> None:
        self.policy.woken(command.rank, self.queue.now)
        self._open(command.rank, command.to_model)

    def _open(self, rank: int, model: str) -> None:
        sim = self._sim(model)
        sim.execute(sim.scheduler.open_rollout_rank(self.world[model][rank]))

    def occupy(self, rank: int, seconds: float, stage: str) -> float:
        """A pooled trainer's GPU work on pool rank `rank`: the engine awake (or waking) there pauses for it.
        Returns when it ends."""
        engine = next(engine for engine in self.engines[rank].values() if not engine.asleep)
        self.gpu_free_at[rank] = engine.pause(seconds, stage)
        return self.gpu_free_at[rank]

    def _live_trainer_gpus(self) -> set[int]:
        """Pool ranks that host a trainer of a job still running: never released."""
        return {rank for model, sim in zip(self.models, self.sims) if sim.end_time is None
                for gpus in self.trainer_gpus.get(model, ()) for rank in gpus}

    def _sim(self, model: str) -> PooledSimulation:
        return self.sims[self.models.index(model)]

    def served_s(self, end: float) -> dict[str, float]:
        served = dict(self._served)
        for rank, state in enumerate(self.policy.ranks):
            served[state.awake] += end - self._awake_since[rank]
        return served
