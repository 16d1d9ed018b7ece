"""The scheduler as a pure state machine: staleness bound for every trained group, no starvation, modes."""
from functools import partial

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from marlaas_hpc.scheduler import (CANCELLED, DONE, Cancel, Scheduler, SchedulerConfig, Submit, Generate, Train,
                                   Admit, StepDone, Generated, Resumed, Scored)
from support.checks import assert_bound_and_progress
from support.configs import task_spec
from support.simloop import SimLoop
from support.workloads import RandomDurations


spec = partial(task_spec, steps=5)  # the scheduler tests' tasks: 5 steps unless told


def simulate(specs, mode="async", seed=0, rollout_ranks=2, slots=3, order="fair", tail=1.0, max_active=8,
             jitter=0.0, trainer_slots=4):
    loop = SimLoop.__new__(SimLoop)
    config = SchedulerConfig(mode=mode, order=order, rollout_ranks=tuple(range(1, rollout_ranks + 1)),
                             env_ranks=(99,), rollout_slots=slots, max_adapters=max_active,
                             trainer_slots=trainer_slots)
    scheduler = Scheduler(config, clock=lambda: loop.now)
    SimLoop.__init__(loop, scheduler, RandomDurations(seed, tail), delivery_jitter=jitter, seed=seed)
    for s in specs:
        loop.submit(s)
    return scheduler, loop.run()


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), bounds=st.lists(st.integers(0, 3), min_size=1, max_size=6),
       mode=st.sampled_from(["async", "sync", "sequential"]), ranks=st.integers(1, 3), slots=st.integers(1, 5),
       batch=st.integers(1, 4), tail=st.floats(0.1, 2.0), jitter=st.sampled_from([0.0, 0.5, 3.0]),
       trainer_slots=st.integers(1, 4))
def test_property_no_trained_sample_exceeds_bound_and_no_starvation(seed, bounds, mode, ranks, slots, batch, tail,
                                                                    jitter, trainer_slots):
    """Random stage times, task counts, bounds, modes, trainer fusion, and events from different ranks arriving
    out of order."""
    specs = [spec(f"t{i}", k, steps=4, batch=batch) for i, k in enumerate(bounds)]
    scheduler, result = simulate(specs, mode=mode, seed=seed, rollout_ranks=ranks, slots=slots, tail=tail,
                                 jitter=jitter, trainer_slots=trainer_slots)
    assert_bound_and_progress(scheduler, result, specs)
    assert all(not t.generating and not t.scoring and not t.ready for t in scheduler.tasks.values())


def test_scored_overtaking_generated_does_not_leak_a_group():
    specs = [spec("a", 0, steps=12, batch=2)]
    scheduler, result = simulate(specs, seed=11, jitter=5.0)
    assert_bound_and_progress(scheduler, result, specs)


def test_late_generated_with_a_newer_version_keeps_the_oldest_groups_first():
    """A group's Scored can overtake its Generated, which may then report a newer sampling version than the one
    issued: the group, already ready, must move behind the older ones (they are closest to the bound)."""
    now = [0.0]
    sched = Scheduler(SchedulerConfig(rollout_ranks=(1,), env_ranks=(2,), rollout_slots=50), clock=lambda: now[0])
    sched.handle(Submit(spec("a", 2, steps=4, batch=3)))
    gids = [g for c in sched.handle(StepDone("a", 0)) if isinstance(c, Generate) for g, _ in c.groups]
    assert len(gids) == 9  # (k+1)·B at v0
    sched.handle(Generated(1, tuple(gids[:3])))
    assert [type(c) for gid in gids[:3] for c in sched.handle(Scored(gid, 1.0))] == [Train]
    sched.handle(StepDone("a", 1))
    sched.handle(Scored(gids[3], 0.0))
    sched.handle(Scored(gids[4], 0.0))
    sched.handle(Generated(1, (gids[3], gids[4]), versions=(1, 0)))  # gids[3] was sampled with v1
    assert [g.group_id for g in sched.tasks["a"].ready] == [gids[4], gids[3]]
    sched.handle(Generated(1, (gids[5],)))
    (train,) = [c for c in sched.handle(Scored(gids[5], 0.0)) if isinstance(c, Train)]
    assert train.group_ids == (gids[4], gids[5], gids[3])
    assert train.behaviour_versions == (0, 0, 1)
    sched.handle(StepDone("a", 2))
    assert {r.group_id: r.behaviour_version for r in sched.audit if r.trained_into == 2}[gids[3]] == 1


def test_a_step_s_groups_go_to_the_trainer_in_sampling_order_whatever_order_they_were_scored_in():
    """Env ranks score a version's groups in any order; the Train lists them by version, then prompt: the
    trainer's float sums (and the adapter bytes) do not depend on which env rank answered first."""
    trains = []
    for order in ((0, 1, 2), (2, 0, 1)):
        sched = Scheduler(SchedulerConfig(rollout_ranks=(1,), env_ranks=(2,), rollout_slots=50), clock=lambda: 0.0)
        sched.handle(Submit(spec("a", 0, steps=2, batch=3)))
        gids = [g for c in sched.handle(StepDone("a", 0)) if isinstance(c, Generate) for g, _ in c.groups]
        sched.handle(Generated(1, tuple(gids)))
        commands = [c for i in order for c in sched.handle(Scored(gids[i], float(i)))]
        trains += [c.group_ids for c in commands if isinstance(c, Train)]
    assert trains == [tuple(gids)] * 2


def test_a_slot_is_held_for_a_turn_in_the_engine_not_through_tool_waits():
    """A multi-turn group's Generated (its turn left the engine) frees its rollout slot for another task's groups;
    its Resumed (next turn entered the batch) takes one again, past rollout_slots if need be, and no new group is
    issued to the rank until the load is below its slots again."""
    sched = Scheduler(SchedulerConfig(rollout_ranks=(1,), env_ranks=(2,), rollout_slots=2), clock=lambda: 0.0)
    sched.handle(Submit(spec("tool", 1, steps=4, batch=2)))
    sched.handle(Submit(spec("fast", 1, steps=4, batch=2)))
    issued = sched.handle(StepDone("tool", 0))
    assert [(c.task_id, len(c.groups)) for c in issued if isinstance(c, Generate)] == [("tool", 2)]
    assert sched.handle(StepDone("fast", 0)) == []  # both slots are taken
    tool_groups = [g for c in issued for g, _ in c.groups]
    freed = sched.handle(Generated(1, (tool_groups[0],)))  # its first turn is done: it waits on a tool now
    assert [(c.task_id, len(c.groups)) for c in freed if isinstance(c, Generate)] == [("fast", 1)]
    assert sched.handle(Resumed(1, (tool_groups[0],))) == []  # its next turn: 3 turns in the engine, 2 slots
    assert sched.rollout_load[1] == 3
    assert sched.handle(Generated(1, (tool_groups[1],))) == []  # still at its slots: nothing new is issued
    assert [len(c.groups) for c in sched.handle(Generated(1, (tool_groups[0],))) if isinstance(c, Generate)] == [1]
    assert sched.rollout_load[1] == 2  # below its slots again: the freed one went to a new group
    assert sched.tasks["tool"].scoring.keys() == set(tool_groups)  # a later turn's Generated only frees the slot


def test_on_policy_k0_trains_only_current_version():
    specs = [spec("a", 0, steps=6), spec("b", 0, steps=6)]
    scheduler, result = simulate(specs, seed=3)
    assert_bound_and_progress(scheduler, result, specs)
    assert all(r.staleness == 0 for r in scheduler.audit)


def test_larger_bound_is_used():
    specs = [spec(f"t{i}", 2, steps=8, batch=2) for i in range(4)]
    scheduler, result = simulate(specs, seed=5, slots=4)
    assert_bound_and_progress(scheduler, result, specs)
    assert max(r.staleness for r in scheduler.audit) >= 1  # off-policy samples actually trained


def test_admission_control_limits_outstanding_groups():
    loop_now = [0.0]
    sched = Scheduler(SchedulerConfig(rollout_ranks=(1, 2), env_ranks=(3,), rollout_slots=50),
                      clock=lambda: loop_now[0])
    commands = sched.handle(Submit(spec("a", 1, steps=10, batch=3)))
    assert [type(c) for c in commands] == [Admit]
    commands = sched.handle(StepDone("a", 0))
    issued = sum(len(c.groups) for c in commands if isinstance(c, Generate))
    assert issued == (1 + 1) * 3  # (k+1)·B
    assert sched.tasks["a"].outstanding() == 6


def test_stale_groups_are_dropped_not_trained():
    now = [0.0]
    sched = Scheduler(SchedulerConfig(rollout_ranks=(1,), env_ranks=(2,), rollout_slots=10), clock=lambda: now[0])
    sched.handle(Submit(spec("a", 0, steps=3, batch=1)))
    cmds = sched.handle(StepDone("a", 0))
    (gen,) = [c for c in cmds if isinstance(c, Generate)]
    (gid,) = [g for g, _ in gen.groups]
    # k=0, B=1: one group at v0 outstanding; train it, then pretend a late v0 group arrives after v1
    cmds = sched.handle(Generated(1, (gid,))) + sched.handle(Scored(gid, 1.0))
    (train,) = [c for c in cmds if isinstance(c, Train)]
    assert train.behaviour_versions == (0,)
    late = sched.tasks["a"]
    from marlaas_hpc.scheduler.state import Group
    ghost = Group("a/ghost", "a", 99, 0, 1, 2)
    sched._group_of[ghost.group_id] = ghost
    late.scoring[ghost.group_id] = ghost
    sched.env_load[2] += 1
    sched.handle(Scored(ghost.group_id, 0.0))
    cmds = sched.handle(StepDone("a", 1))
    assert late.dropped_groups == 1
    assert all(r.group_id != "a/ghost" for r in sched.audit)


def test_sync_mode_is_lockstep():
    specs = [spec(f"t{i}", 2, steps=4) for i in range(3)]
    scheduler, result = simulate(specs, mode="sync", seed=1)
    assert_bound_and_progress(scheduler, result, specs)
    assert all(r.staleness == 0 for r in scheduler.audit)


def test_sequential_runs_one_task_at_a_time():
    specs = [spec(f"t{i}", 2, steps=3) for i in range(3)]
    scheduler, result = simulate(specs, mode="sequential", seed=2)
    assert_bound_and_progress(scheduler, result, specs)
    spans = sorted((scheduler.tasks[s.task_id].step_times[0], scheduler.tasks[s.task_id].step_times[-1])
                   for s in specs)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), "task steps do not interleave"


def test_async_beats_sync_and_sequential_with_long_tails():
    specs = [spec(f"t{i}", 1, steps=6, batch=2) for i in range(6)]
    ends = {m: simulate(specs, mode=m, seed=7, rollout_ranks=2, slots=4, tail=1.5)[1].end_time
            for m in ("async", "sync", "sequential")}
    assert ends["async"] < ends["sync"] < ends["sequential"], ends


def test_cancel_at_step_boundary_and_queue_admission():
    specs = [spec("a", 1, steps=50), spec("b", 1, steps=3), spec("c", 1, steps=3)]
    loop = SimLoop.__new__(SimLoop)
    sched = Scheduler(SchedulerConfig(rollout_ranks=(1,), env_ranks=(2,), max_adapters=2),
                      clock=lambda: loop.now)
    SimLoop.__init__(loop, sched, RandomDurations(0))
    for s in specs:
        loop.submit(s)
    loop.at(5.0, Cancel("a"))
    result = loop.run()
    assert result.ended == {"a": CANCELLED, "b": DONE, "c": DONE}
    assert sched.tasks["c"].admitted_at >= sched.tasks["a"].step_times[-1] or \
        sched.tasks["c"].admitted_at >= sched.tasks["b"].step_times[-1]
    assert 0 < sched.tasks["a"].version < 50
