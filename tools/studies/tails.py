"""What long completions cost in a simulated job (issue #29, item 2's measurement): groups dropped at the
staleness bound (their rollout and scoring compute lost), and engine time spent decoding few sequences while a
task waits for its slowest group.

`OccupancyRolloutSim` is the continuous-batching rollout rank with one addition: decode seconds by the number of
sequences running (the batch is constant between two of the engine's `_advance` calls, so the tally is exact).
`Simulation(..., rollout_engine=OccupancyRolloutSim)` uses it; `tail_costs` reads it with the scheduler's books.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from marlaas_hpc.sim.engine import RolloutSim, Simulation


class OccupancyRolloutSim(RolloutSim):
    """A RolloutSim that tallies decode seconds per running-batch size (`occupancy`)."""

    def __init__(self, sim: Simulation, rank: int):
        super().__init__(sim, rank)
        self.occupancy: dict[int, float] = defaultdict(float)
        """Running sequences -> seconds the engine decoded with that many (stalls excluded)."""

    def _advance(self) -> None:
        start = self.last if self.last > self.stall_until else self.stall_until
        now = self.sim.queue.now
        if self.running and now > start:
            self.occupancy[len(self.running)] += now - start
        super()._advance()


@dataclass
class TailCosts:
    issued_groups: int
    """Training groups issued (dynamic sampling's filtered ones included)."""
    trained_groups: int
    dropped_groups: int
    """Groups discarded at the staleness bound (`Scheduler._drop_stale`): generated and scored, never trained."""
    dropped_samples: int
    decode_seconds: float
    """Seconds the rollout ranks decoded, summed over ranks."""
    sparse_decode_seconds: float
    """Of those, seconds with fewer than `sparse_below` sequences running."""
    sparse_below: int

    @property
    def sparse_fraction(self) -> float:
        return self.sparse_decode_seconds / self.decode_seconds if self.decode_seconds else 0.0


def tail_costs(sim: Simulation, sparse_share: float = 0.25) -> TailCosts:
    """The long tail's costs after `sim.run()`: drops from the scheduler's books, and decode time with under
    `sparse_share` of an engine's max_running_sequences busy (needs `OccupancyRolloutSim`)."""
    tasks = sim.scheduler.tasks.values()
    sizes = {task.task_id: sim.task_spec(task.task_id).algo.group_size for task in tasks}
    below = max(1, int(sim.workload.rollout.max_running_sequences * sparse_share))
    decode = sparse = 0.0
    for rollout in sim.rollout.values():
        for running, seconds in rollout.occupancy.items():
            decode += seconds
            sparse += seconds if running < below else 0.0
    return TailCosts(issued_groups=sum(task.next_prompt for task in tasks),
                     trained_groups=sum(task.trained_groups for task in tasks),
                     dropped_groups=sum(task.dropped_groups for task in tasks),
                     dropped_samples=sum(task.dropped_groups * sizes[task.task_id] for task in tasks),
                     decode_seconds=decode, sparse_decode_seconds=sparse, sparse_below=below)
