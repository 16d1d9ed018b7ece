"""Dynamic sampling (scheduler/sampling.py): groups whose rewards are all equal are dropped and replaced inside
the staleness bound, so every step trains B informative groups; the simulator pays for the replacements."""
import hashlib
from functools import partial
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from marlaas_hpc.scheduler import (DONE, Admit, Discard, Generate, Generated, Scheduler, SchedulerConfig, Scored,
                                   StepDone, Submit, Train)
from marlaas_hpc.tasks import SpecError, TaskSpec
from support.configs import task_spec
from support.simloop import SimLoop
from support.workloads import RandomDurations

ROOT = Path(__file__).resolve().parents[1]


spec = partial(task_spec, steps=4)  # the dynamic sampling tests' tasks: 4 steps unless told


def _scheduler(mode="async"):
    return Scheduler(SchedulerConfig(mode=mode, rollout_ranks=(1,), env_ranks=(2,), rollout_slots=8), clock=lambda: 0.0)


def _generated(commands):
    return [gid for c in commands if isinstance(c, Generate) for gid, _ in c.groups]


def test_an_uninformative_group_is_dropped_and_replaced_at_once():
    scheduler = _scheduler()
    assert isinstance(scheduler.handle(Submit(spec("t", k=0, dynamic_sampling=True)))[0], Admit)
    issued = _generated(scheduler.handle(StepDone("t", 0)))
    assert issued == ["t/g0", "t/g1"]  # (k+1) B = 2 groups outstanding
    scheduler.handle(Generated(1, tuple(issued)))
    out = scheduler.handle(Scored("t/g0", 1.0, informative=False))
    assert [c.reason for c in out if isinstance(c, Discard)] == ["uninformative: equal rewards (dynamic sampling)"]
    assert _generated(out) == ["t/g2"]  # its replacement, at the task's version, within the window
    assert scheduler.tasks["t"].filtered_groups == 1 and scheduler.tasks["t"].outstanding() == 2
    scheduler.handle(Scored("t/g1", 0.5, informative=True))
    scheduler.handle(Generated(1, ("t/g2",)))
    trains = [c for c in scheduler.handle(Scored("t/g2", 0.5)) if isinstance(c, Train)]
    assert [t.group_ids for t in trains] == [("t/g1", "t/g2")]


def test_without_dynamic_sampling_an_uninformative_group_is_trained():
    scheduler = _scheduler()
    scheduler.handle(Submit(spec("t", k=0)))
    scheduler.handle(StepDone("t", 0))
    scheduler.handle(Generated(1, ("t/g0", "t/g1")))
    assert scheduler.handle(Scored("t/g0", 1.0, informative=False)) == []
    assert [c.group_ids for c in scheduler.handle(Scored("t/g1", 1.0, informative=False))
            if isinstance(c, Train)] == [("t/g0", "t/g1")]


def test_dapo_samples_dynamically_by_default_and_patience_lets_a_saturated_task_go_on():
    """patience 1 x B 2: two uninformative groups in a row are dropped, the third is trained (all rewards 1:
    nothing left to learn, but the task must still reach its steps)."""
    scheduler = _scheduler()
    scheduler.handle(Submit(spec("t", k=0, loss="dapo", dynamic_sampling_patience=1)))
    scheduler.handle(StepDone("t", 0))
    dropped = []
    for n in range(3):
        gid = f"t/g{n}"
        scheduler.handle(Generated(1, (gid,)))
        dropped += [c for c in scheduler.handle(Scored(gid, 1.0, informative=False)) if isinstance(c, Discard)]
    assert [c.group_ids for c in dropped] == [("t/g0",), ("t/g1",)]
    assert scheduler.tasks["t"].ready[0].group_id == "t/g2"
    scheduler.handle(Generated(1, ("t/g3",)))
    scheduler.handle(Scored("t/g3", 0.5, informative=True))  # an informative group resets the run
    assert scheduler.tasks["t"].uninformative_run == 0


class Durations(RandomDurations):
    """Long-tailed stage times; a group is uninformative with probability `equal` (a hash of its id: the
    decision does not depend on event order)."""

    def __init__(self, seed, equal):
        super().__init__(seed)
        self.seed, self.equal = seed, equal
        self.decided: dict[str, bool] = {}

    def informative(self, task_id, group_id):
        draw = int(hashlib.sha256(f"{self.seed}/{group_id}".encode()).hexdigest()[:8], 16) / 2**32
        self.decided[group_id] = draw >= self.equal
        return self.decided[group_id]


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), mode=st.sampled_from(["async", "sync"]), equal=st.sampled_from([0.3, 0.6]),
       bounds=st.lists(st.integers(0, 2), min_size=1, max_size=3), jitter=st.sampled_from([0.0, 0.5]))
def test_every_step_trains_b_informative_groups_within_the_bound(seed, mode, equal, bounds, jitter):
    """Under reordered events (jitter: a Scored may overtake its Generated) and long-tailed generations."""
    specs = [spec(f"t{i}", k=k, steps=4, batch=2, dynamic_sampling=True, dynamic_sampling_patience=1000)
             for i, k in enumerate(bounds)]
    durations = Durations(seed, equal)
    loop = SimLoop.__new__(SimLoop)
    scheduler = Scheduler(SchedulerConfig(mode=mode, rollout_ranks=(1, 2), env_ranks=(9,), rollout_slots=3),
                          clock=lambda: loop.now)
    SimLoop.__init__(loop, scheduler, durations, delivery_jitter=jitter, seed=seed)
    for s in specs:
        loop.submit(s)
    result = loop.run()
    assert result.ended == {s.task_id: DONE for s in specs}
    for train in result.trains:
        assert len(train.group_ids) == 2 and all(durations.decided[g] for g in train.group_ids), train
    for record in scheduler.audit:
        assert 0 <= record.staleness <= record.bound, record
    filtered = sum(t.filtered_groups for t in scheduler.tasks.values())
    assert filtered == sum(not informative for informative in durations.decided.values())


# ---------------------------------------------------------------------------------------------- simulator
def _simulate(equal: float, dynamic: bool, mode="async"):
    from marlaas_hpc.config import JobConfig
    from marlaas_hpc.sim.engine import Simulation
    from marlaas_hpc.sim.setup import setup_from_job
    from marlaas_hpc.sim.workload import load_workload

    job = JobConfig.load(ROOT / "configs" / "calib-small.yaml")
    tasks = [TaskSpec.from_dict({**t.to_dict(), "algo": {**t.to_dict()["algo"], "dynamic_sampling": dynamic}})
             for t in job.tasks]
    workload = load_workload(ROOT / "configs/workloads/tiny-cpu.yaml")
    for profile in workload.profiles.values():
        profile.equal_reward_groups = equal
    sim = Simulation(setup_from_job(job, mode=mode, tasks=tasks), workload, seed=4)
    return sim, sim.run()


def test_the_simulator_pays_for_the_replacements_and_keeps_the_bound():
    from marlaas_hpc.sim.report import staleness_violations

    plain_sim, plain = _simulate(0.5, dynamic=False)
    _, zero = _simulate(0.0, dynamic=False)
    assert plain.trace_hash == zero.trace_hash  # a job without dynamic sampling draws nothing from the fraction
    sim, outcome = _simulate(0.5, dynamic=True)
    tasks = sim.scheduler.tasks.values()
    assert set(outcome.ended.values()) == {"done"} and not staleness_violations(sim)
    issued = sum(t.next_prompt for t in tasks)
    filtered = sum(t.filtered_groups for t in tasks)
    trained = sum(t.trained_groups for t in tasks)
    assert trained == sum(t.total_steps * t.batch for t in tasks)
    assert 0.35 < filtered / (filtered + trained) < 0.65  # about half the scored groups were dropped
    assert issued > sum(t.next_prompt for t in plain_sim.scheduler.tasks.values())
    assert outcome.end_time > plain.end_time  # more rollouts for the same steps


def test_equal_reward_groups_is_a_fraction():
    from marlaas_hpc.sim.workload import workload_from_dict

    assert workload_from_dict({"profiles": {"default": {"equal_reward_groups": 0.25}}}).profile(
        "sort").equal_reward_groups == 0.25
    with pytest.raises(SpecError) as error:
        workload_from_dict({"profiles": {"default": {"equal_reward_groups": 1.5}}})
    assert error.value.field == "profiles.default.equal_reward_groups" and "fraction" in error.value.reason
