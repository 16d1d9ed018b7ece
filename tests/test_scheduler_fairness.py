"""Fair progress with more ready work than trainer capacity (SimLoop, simulated time): no task waits more than
a bounded number of other tasks' optimizer steps between two of its own.

Bound (trainer_slots s, n tasks, each ready again as soon as its step lands: k >= 1 and generation faster than
training): between two steps of task X there can be
  - up to s-1 steps that were already in flight when X's step landed,
  - one step of each other task started while X waits (least recently trained first: a task that has
    trained goes behind X, so it cannot overtake X twice),
  - up to s-1 steps started beside X's own step, which may land before it,
so at most (n-1) + 2(s-1). With order 'priority' the same holds counting only tasks of X's priority or lower,
with n = the tasks of X's priority (higher ones may pass X at will: that is what priority means)."""
import random

import pytest

from marlaas_hpc.scheduler import DONE, Scheduler, SchedulerConfig
from marlaas_hpc.tasks import TaskSpec
from support.simloop import SimLoop


class TrainerBound:
    """Generation fast, training slow (+-30 %): the trainer is the bottleneck, every task is mostly ready."""

    def __init__(self, seed: int, generate_s: float):
        self.rng, self.generate_s = random.Random(seed), generate_s

    def generate(self, task_id, group_id):
        return self.generate_s * self.rng.uniform(0.7, 1.3)

    def score(self, task_id, group_id):
        return 0.01

    def train(self, task_id, n_groups):
        return self.rng.uniform(0.7, 1.3)

    def publish(self, task_id):
        return 0.0


def run(order: str, n_tasks: int, trainer_slots: int, generate_s: float, seed: int, priorities: list[int]):
    loop = SimLoop.__new__(SimLoop)
    config = SchedulerConfig(order=order, rollout_ranks=(1, 2), env_ranks=(99,), rollout_slots=8,
                             max_adapters=n_tasks, trainer_slots=trainer_slots)
    scheduler = Scheduler(config, clock=lambda: loop.now)
    SimLoop.__init__(loop, scheduler, TrainerBound(seed, generate_s))
    for i in range(n_tasks):
        loop.submit(TaskSpec.from_dict({"task_id": f"t{i}", "max_staleness": 1, "total_steps": 15,
                                        "priority": priorities[i], "algo": {"batch_prompts": 2, "group_size": 2}}))
    result = loop.run()
    assert set(result.ended.values()) == {DONE}
    return scheduler


def worst_gaps(scheduler) -> dict[str, int]:
    """Per task: most steps of tasks with priority <= its own between two of its consecutive steps."""
    steps = sorted((time, task_id) for task_id, task in scheduler.tasks.items() for time in task.step_times)
    worst = {}
    for task_id, task in scheduler.tasks.items():
        mine = [i for i, (_, owner) in enumerate(steps) if owner == task_id]
        assert len(mine) == task.spec.total_steps
        worst[task_id] = max(sum(scheduler.tasks[owner].spec.priority <= task.spec.priority
                                 for _, owner in steps[a + 1:b]) for a, b in zip(mine, mine[1:]))
    return worst


CASES = [(8, 1, 0.2), (8, 2, 0.2), (6, 4, 0.1), (16, 2, 0.3), (12, 3, 0.5)]


@pytest.mark.parametrize("n_tasks, trainer_slots, generate_s", CASES)
def test_fair_order_bounds_the_wait_between_a_tasks_steps(n_tasks, trainer_slots, generate_s):
    bound = (n_tasks - 1) + 2 * (trainer_slots - 1)
    for seed in range(6):
        gaps = worst_gaps(run("fair", n_tasks, trainer_slots, generate_s, seed, [0] * n_tasks))
        assert max(gaps.values()) <= bound, (seed, gaps)
    if trainer_slots == 1:
        assert max(gaps.values()) == bound, "the bound is tight: with one slot each task waits for all others"


@pytest.mark.parametrize("n_tasks, trainer_slots, generate_s", CASES)
def test_priority_order_is_fair_among_equals_and_never_waits_for_lower(n_tasks, trainer_slots, generate_s):
    priorities = [i % 3 for i in range(n_tasks)]
    for seed in range(6):
        scheduler = run("priority", n_tasks, trainer_slots, generate_s, seed, priorities)
        for task_id, gap in worst_gaps(scheduler).items():
            peers = priorities.count(scheduler.tasks[task_id].spec.priority)
            assert gap <= (peers - 1) + 2 * (trainer_slots - 1), (seed, task_id, gap)
        ends = {p: max(t.step_times[-1] for t in scheduler.tasks.values() if t.spec.priority == p) for p in (0, 1, 2)}
        assert ends[2] < ends[0], "the highest priority finishes before the lowest"
