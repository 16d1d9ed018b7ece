"""Inputs of the simulated scheduler in tests: seeded stage durations, and the bench's gap workload."""
from __future__ import annotations

import random
import sys

from support.jobs import ROOT


class RandomDurations:
    """Long-tailed generation, variable scoring and training times, seeded."""

    def __init__(self, seed: int, tail: float = 1.0):
        self.rng = random.Random(seed)
        self.tail = tail

    def generate(self, task_id, group_id):
        return self.rng.lognormvariate(0.0, self.tail)

    def score(self, task_id, group_id):
        return self.rng.uniform(0.01, 0.5)

    def train(self, task_id, n_groups):
        return self.rng.uniform(0.1, 1.0)

    def publish(self, task_id):
        return 0.05


def gap_jobs(steps=3, tool_latency_s=2.0):
    """The bench's gap workload, one task and one rollout rank per job: on-policy GSM8K and web-search jobs."""
    sys.path.insert(0, str(ROOT / "tools"))
    from bench_multiplex import gap_jobs as bench_gap_jobs

    return bench_gap_jobs(tasks=1, ranks=1, steps=steps, tool_latency_s=tool_latency_s)
