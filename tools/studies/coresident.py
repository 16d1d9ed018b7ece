"""K jobs of different base models whose engines stay resident side by side on one shared pool (issue #28).

    job j: PooledSimulation (its scheduler sees every pool rank, always open)  ─┐
                                                                                ├─ one EventQueue
    pool rank i: one CoresidentRolloutSim per model, all awake, decoding at once ┘

The time-slicing pool (multiplex.py `SharedPool`) keeps one engine awake per GPU and switches whole engines;
a switch waits for the donor model's long-tailed groups to drain, so a GPU whose model is down to a few
stragglers (or whose sequences wait on tool calls) is rarely handed over. Here every model's engine is awake on
every pool GPU, each with its own share of the KV cache (two 0.6B models' engines fit one 80 GB H100 with room
for their batches; memory is not modelled, `marlaas plan` checks a real job), so another model's groups decode
in those gaps without a switch: space-sharing. The cost is interference: while two engines decode on one GPU,
each engine step also waits for `interference` x the other engines' steps (1.0: the GPU runs one engine's step
at a time, no overlap at all, as CUDA time-slices two processes' contexts without MPS; 0.0: perfect overlap).
The default is the pessimistic 1.0: not measured (no GPU here).

Each job keeps its own scheduler, unchanged, with every pool rank open to it at the job's `rollout_slots`.
`trainers_in_pool` places the trainer ranks as tools/studies/multiplex.py does (one per GPU from the front; their steps
pause every engine on that GPU); `release` gives back, when a job ends, the ranks beyond what the jobs still
running had alone (never one hosting a live trainer): they are closed to every scheduler and count until their
engines are empty.
"""
from __future__ import annotations

import dataclasses

from marlaas_hpc.scheduler import Submit
from marlaas_hpc.sim.driver import EventQueue
from marlaas_hpc.sim.engine import RolloutSim, Simulation
from marlaas_hpc.tasks.spec import SpecError
from studies.multiplex import (PooledRolloutSim, PooledSimulation, PooledTrainerSim, PoolJob, PoolResult,
                               pooled_results, trainer_placement)


class CoresidentRolloutSim(PooledRolloutSim):
    """One model's engine on a GPU shared with other models' engines, all awake: its decode step takes its own
    time plus `interference` x the step of every neighbour that is decoding too. A change in any engine's batch
    changes its neighbours' rates, so they are brought up to now first and their next completion re-filed."""

    def __init__(self, sim: Simulation, rank: int, interference: float):
        super().__init__(sim, rank, on_group_done=lambda seconds: None)
        self.interference = interference
        self.neighbours: list[CoresidentRolloutSim] = []
        """The other models' engines on this GPU."""

    def _step_time(self, sequences: int) -> float:
        own = RolloutSim._step_time(self, sequences)
        return own + self.interference * sum(RolloutSim._step_time(n, len(n.running))
                                             for n in self.neighbours if n.running)

    def _enter(self, sequence) -> None:
        self._before_change()
        super()._enter(sequence)
        self._after_change()

    def _wake(self, token) -> None:
        if token is not self.wakeup:
            return
        self._before_change()
        super()._wake(token)
        self._after_change()

    def stop(self) -> None:
        self._before_change()
        super().stop()
        self._after_change()

    def _before_change(self) -> None:
        for neighbour in self.neighbours:
            neighbour._advance()  # tokens so far at the old rate

    def _after_change(self) -> None:
        for neighbour in self.neighbours:  # a completion now due sooner is filed again (a later one finds
            neighbour._schedule()           # nothing finished when its old wake-up comes, and files it then)


def run_coresident(jobs: list[PoolJob], ranks: int, seed: int = 0, interference: float = 1.0,
                   trainers_in_pool: bool = False, release: bool = False, tick_s: float = 0.05,
                   horizon_s: float = 1e6) -> PoolResult:
    """Every job on one pool of `ranks` GPUs, every model's engine resident on every GPU (module doc). GPU-hours
    as tools/studies/multiplex.py counts them: the pool's GPUs until the last job ends (or until given back), a job's
    trainer GPUs outside the pool until it ends."""
    pool = CoresidentPool(jobs, ranks, seed, interference, trainers_in_pool, release, tick_s)
    pool.run(horizon_s)
    results, held, hours = pooled_results(jobs, pool.sims, pool.released_at, ranks, horizon_s, trainers_in_pool)
    # engines on one GPU overlap in time: a rank's busy time is capped at its held time (idle: a lower bound)
    busy = sum(min(held[rank], sum(engine.meter.busy for engine in engines.values()))
               for rank, engines in enumerate(pool.engines))
    return PoolResult(results, ranks, hours, pool_idle_s=max(0.0, sum(held) - busy))


class CoresidentPool:
    """The driver: K job simulations on one event queue, their rollout ranks replaced by the pool's engines,
    every engine awake."""

    def __init__(self, jobs: list[PoolJob], ranks: int, seed: int, interference: float,
                 trainers_in_pool: bool, release: bool, tick_s: float):
        models = [job.model for job in jobs]
        if len(set(models)) != len(models):
            raise SpecError("jobs", f"each job of a shared pool needs its own model, got {models}")
        if not 0.0 <= interference <= 1.0:
            raise SpecError("interference", f"must be within [0, 1], got {interference}")
        for job in jobs:
            if job.workload.evals:
                raise SpecError(f"{job.model}.workload.evals", "evals are not modelled on a shared pool: set false")
        self.queue, self.tick_s, self.jobs, self.models = EventQueue(), tick_s, jobs, models
        self.engines: list[dict[str, CoresidentRolloutSim]] = [{} for _ in range(ranks)]
        self.trainer_gpus = trainer_placement(jobs, ranks) if trainers_in_pool else {}
        self.gpu_free_at = [0.0] * ranks
        self.world: dict[str, tuple[int, ...]] = {}
        """Per model: the world rank, in its job's numbering, of each pool rank."""
        self.sims: list[PooledSimulation] = []
        for index, job in enumerate(jobs):
            sim = PooledSimulation(dataclasses.replace(job.setup, rollout_ranks=ranks), job.workload,
                                   seed=seed + index)
            sim.queue = self.queue
            # a scheduler fills its ranks in config order: each job's first ranks are other GPUs than the
            # previous jobs' (spread evenly), so two models decode side by side only once a GPU's own fill up
            first = round(index * ranks / len(jobs))
            world = sim.setup.world_ranks()["rollout"]
            world = self.world[job.model] = tuple(world[(i - first) % ranks] for i in range(ranks))
            sim.rollout = {}
            for i, rank in enumerate(world):
                self.engines[i][job.model] = sim.rollout[rank] = CoresidentRolloutSim(sim, rank, interference)
            if trainers_in_pool:
                sim.trainers = [PooledTrainerSim(sim, g, self, gpus)
                                for g, gpus in enumerate(self.trainer_gpus[job.model])]
            self.sims.append(sim)
        for engines in self.engines:
            for engine in engines.values():
                engine.neighbours = [other for other in engines.values() if other is not engine]
        self.release = release
        self.released_at: dict[int, float] = {}
        """Pool rank -> when it was given back (its engines empty after it was closed)."""
        self._closing: set[int] = set()
        self._ended: set[str] = set()

    def run(self, horizon_s: float) -> None:
        for sim in self.sims:
            for spec in sim.setup.tasks:
                self.queue.at(0.0, sim.scheduler_event, Submit(spec))
        self.queue.at(0.0, self._tick)  # the tick keeps the queue alive: the horizon ends a job that hangs
        self.queue.run(until_idle=lambda: self.queue.now > horizon_s
                       or all(sim.end_time is not None for sim in self.sims))

    def occupy(self, rank: int, seconds: float, stage: str) -> float:
        """A pooled trainer's GPU work on `rank`: every engine there pauses for it. Returns when it ends."""
        self.gpu_free_at[rank] = max(engine.pause(seconds, stage) for engine in self.engines[rank].values())
        return self.gpu_free_at[rank]

    def _tick(self) -> None:
        if self.release:
            self._release()
        self.queue.after(self.tick_s, self._tick)

    def _release(self) -> None:
        running = [(job, sim) for job, sim in zip(self.jobs, self.sims) if sim.end_time is None]
        newly_ended = {job.model for job, sim in zip(self.jobs, self.sims) if sim.end_time is not None} - self._ended
        if newly_ended:
            self._ended |= newly_ended
            pinned = {rank for job, _ in running for gpus in self.trainer_gpus.get(job.model, ()) for rank in gpus}
            keep = max(sum(job.setup.rollout_ranks for job, _ in running), len(pinned))
            open_ranks = [r for r in range(len(self.engines)) if r not in self._closing]
            # the emptiest ranks go: the fewest groups of the running jobs to wait for before a GPU is free
            candidates = sorted((r for r in open_ranks if r not in pinned), key=lambda r: (sum(
                self.engines[r][job.model].held for job, _ in running), -r))
            surplus = candidates[:max(0, len(open_ranks) - keep)]
            for rank in surplus:
                self._closing.add(rank)
                for job, sim in running:
                    sim.scheduler.close_rollout_rank(self.world[job.model][rank])
        for rank in self._closing - set(self.released_at):
            if all(not engine.held and not engine.running and not engine.queue
                   for engine in self.engines[rank].values()):
                self.released_at[rank] = self.queue.now
