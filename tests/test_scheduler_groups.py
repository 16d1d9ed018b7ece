"""Trainer groups in the pure scheduler: placement by tokens per step, per-group training, moves at a step
boundary, and the staleness bound and progress with several groups (scheduler/placement.py, core.py)."""
from functools import partial

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from marlaas_hpc.scheduler import (Admit, Move, Moved, Placement, Scheduler, SchedulerConfig, StepDone, Submit,
                                   TaskEnded, Train)
from marlaas_hpc.scheduler.placement import estimated_tokens_per_step
from support.checks import assert_bound_and_progress
from support.configs import task_spec
from support.simloop import SimLoop
from support.workloads import RandomDurations


spec = partial(task_spec, steps=4, tokens=8)  # the trainer groups tests' tasks


class CheckedLoop(SimLoop):
    """SimLoop that checks, after every event, what the groups must never break: a Train goes to the group
    that owns its task, no group has more orders in flight than its slots, and a task moves only when idle."""

    def __init__(self, scheduler, durations, **kw):
        super().__init__(scheduler, durations, **kw)
        self.in_flight: dict[str, int] = {}

    def _execute(self, command):
        tasks = self.scheduler.tasks
        if isinstance(command, Train):
            assert command.trainer_group == tasks[command.task_id].trainer_group
            assert command.task_id not in self.in_flight
            self.in_flight[command.task_id] = command.trainer_group
            per_group = [list(self.in_flight.values()).count(g) for g in range(self.scheduler.config.trainer_groups)]
            assert max(per_group) <= self.scheduler.config.trainer_slots, per_group
        elif isinstance(command, Move):
            assert command.task_id not in self.in_flight, "a task moves only at a step boundary"
            assert command.from_group != command.to_group == tasks[command.task_id].trainer_group
        elif isinstance(command, Admit):
            assert command.trainer_group == tasks[command.spec.task_id].trainer_group
        super()._execute(command)

    def run(self, max_events=10_000_000):
        handle = self.scheduler.handle

        def checked(event):
            if isinstance(event, StepDone) and event.version > 0:
                self.in_flight.pop(event.task_id, None)
            return handle(event)

        self.scheduler.handle = checked
        return super().run(max_events)


def simulate(specs, groups, seed=0, trainer_slots=2, jitter=0.5, mode="async", max_active=8):
    loop = CheckedLoop.__new__(CheckedLoop)
    config = SchedulerConfig(mode=mode, rollout_ranks=(1, 2), env_ranks=(99,), rollout_slots=3,
                             max_adapters=max_active, trainer_slots=trainer_slots, trainer_groups=groups)
    scheduler = Scheduler(config, clock=lambda: loop.now)
    CheckedLoop.__init__(loop, scheduler, RandomDurations(seed), delivery_jitter=jitter, seed=seed)
    for s in specs:
        loop.submit(s)
    return scheduler, loop.run()


# ---------------------------------------------------------------- placement
def test_placement_balances_tokens_per_step_not_task_count():
    placement = Placement(2)
    assert placement.place("heavy", 1000) == 0
    assert [placement.place(f"light{i}", 100) for i in range(3)] == [1, 1, 1]  # count-based would alternate
    assert placement.load == [1000, 300] and placement.tasks == [1, 3]
    assert placement.place("next", 100) == 1  # 300 < 1000
    placement.release("heavy")
    assert placement.load == [0, 400] and placement.place("after", 50) == 0


def test_measured_step_tokens_replace_the_estimate():
    placement = Placement(2)
    placement.place("a", 500)
    placement.place("b", 400)
    placement.observe("a", 100)
    placement.observe("a", 300)
    assert placement.cost["a"] == 200 and placement.load == [200, 400]
    assert placement.place("c", 10) == 0


def test_estimate_is_batch_times_group_times_turn_cap():
    assert estimated_tokens_per_step(spec("x", batch=4, tokens=6)) == 4 * 2 * 6


@pytest.mark.parametrize("loads, cost, expected", [
    ([300, 0], 100, 1),     # 300 -> max(200, 100): lower by a third
    ([300, 250], 100, None),  # max(200, 350) is higher than 300: no
    ([300, 260], 20, None),   # 300 -> 280: gains less than MOVE_GAIN
    ([0, 0], 0, None),
])
def test_move_target_moves_only_when_the_larger_load_falls_enough(loads, cost, expected):
    placement = Placement(2)
    placement.place("t", cost)
    placement.load = list(loads)
    placement.owner["t"] = 0
    assert placement.move_target("t") == expected


@settings(max_examples=100, deadline=None)
@given(costs=st.lists(st.integers(1, 1000), min_size=1, max_size=12), groups=st.integers(2, 4),
       ended=st.lists(st.integers(0, 11), max_size=6))
def test_a_moved_task_never_wants_to_move_back(costs, groups, ended):
    placement = Placement(groups)
    for i, cost in enumerate(costs):
        placement.place(f"t{i}", cost)
    for i in set(ended):
        placement.release(f"t{i}")
    for task_id in list(placement.owner):
        loads_before = list(placement.load)
        target = placement.move_target(task_id)
        if target is None:
            continue
        source = placement.move(task_id, target)
        assert max(placement.load[source], placement.load[target]) < max(loads_before[source], loads_before[target])
        assert placement.move_target(task_id) != source
    assert sum(placement.tasks) == len(placement.owner)
    assert placement.load == pytest.approx([sum(placement.cost[t] for t, g in placement.owner.items() if g == i)
                                            for i in range(groups)])


# ---------------------------------------------------------------- the scheduler
@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), bounds=st.lists(st.integers(0, 3), min_size=1, max_size=7),
       steps=st.lists(st.integers(1, 6), min_size=7, max_size=7), tokens=st.lists(st.integers(1, 64), min_size=7,
                                                                                   max_size=7),
       groups=st.integers(1, 3), trainer_slots=st.integers(1, 3), mode=st.sampled_from(["async", "sync"]))
def test_property_bound_and_progress_with_several_groups(seed, bounds, steps, tokens, groups, trainer_slots, mode):
    """Tasks of different sizes and lengths: every group rule holds after every event (CheckedLoop), the bound
    holds for every trained group, and every task trains each version exactly once."""
    specs = [spec(f"t{i}", k, steps=steps[i], tokens=tokens[i]) for i, k in enumerate(bounds)]
    scheduler, result = simulate(specs, groups, seed=seed, trainer_slots=trainer_slots, mode=mode)
    assert_bound_and_progress(scheduler, result, specs)
    assert scheduler.settled() and not scheduler.trainers.moving
    assert scheduler.trainers.busy == [0] * groups and not scheduler.trainers.placement.owner
    if groups == 1:
        assert not result.moves and {t.trainer_group for t in result.trains} == {0}


def test_tasks_spread_over_groups_and_a_task_moves_when_its_group_empties():
    """One heavy short task fills group 0, three light ones share group 1; once the heavy one is done, a light
    one moves to the idle group at its next step boundary and trains there."""
    specs = [spec("heavy", steps=2, tokens=60), spec("l1", steps=8, tokens=10), spec("l2", steps=8, tokens=10),
             spec("l3", steps=8, tokens=10)]
    scheduler, result = simulate(specs, groups=2, jitter=0.0)
    assert_bound_and_progress(scheduler, result, specs)
    admitted = {t.task_id: t.trainer_group for t in scheduler.tasks.values()}
    assert admitted["heavy"] == 0
    trains = {(t.task_id, t.trainer_group) for t in result.trains}
    assert ("heavy", 0) in trains and {("l1", 1), ("l2", 1), ("l3", 1)} <= trains
    assert len(result.moves) >= 1
    move = result.moves[0]
    assert (move.from_group, move.to_group) == (1, 0) and move.task_id.startswith("l")
    later = [t for t in result.trains if t.task_id == move.task_id and t.from_version >= move.version]
    assert later and all(t.trainer_group == 0 for t in later), "after the move it trains in its new group"
    assert scheduler.tasks[move.task_id].moves >= 1


def test_one_group_issues_no_moves_and_names_group_zero():
    specs = [spec("heavy", steps=2, tokens=60), spec("l1", steps=5, tokens=10), spec("l2", steps=5, tokens=10)]
    scheduler, result = simulate(specs, groups=1)
    assert not result.moves and all(t.trainer_group == 0 for t in result.trains)
    assert all(t.trainer_group == 0 for t in scheduler.tasks.values())


def _train_order(scheduler, commands, task_id):
    """Answers the task's Generate commands (Generated, then Scored) until its Train order comes out."""
    from marlaas_hpc.scheduler import Generate, Generated, Scored

    pending = list(commands)
    while pending:
        command = pending.pop(0)
        if isinstance(command, Train) and command.task_id == task_id:
            return command
        if isinstance(command, Generate) and command.task_id == task_id:
            ids = tuple(g for g, _ in command.groups)
            pending += scheduler.handle(Generated(command.rollout_rank, ids))
            for gid in ids:
                pending += scheduler.handle(Scored(gid, 1.0))
    raise AssertionError(f"no Train for {task_id}")


@pytest.mark.parametrize("draining", [False, True])
def test_a_task_moves_at_its_step_boundary_unless_draining(draining):
    from marlaas_hpc.scheduler import Cancel

    scheduler = Scheduler(SchedulerConfig(rollout_ranks=(1,), env_ranks=(2,), rollout_slots=8, trainer_groups=2),
                          clock=lambda: 0.0)
    out = []
    for s in (spec("heavy", steps=3, tokens=60), spec("b", steps=3, tokens=10), spec("c", steps=3, tokens=10)):
        out += scheduler.handle(Submit(s))
    assert [(c.spec.task_id, c.trainer_group) for c in out if isinstance(c, Admit)] == [
        ("heavy", 0), ("b", 1), ("c", 1)]
    for task_id in ("heavy", "b", "c"):
        out += scheduler.handle(StepDone(task_id, 0))
    train = _train_order(scheduler, out, "b")
    assert train.trainer_group == 1
    assert any(isinstance(c, TaskEnded) for c in scheduler.handle(Cancel("heavy")))  # group 0 is empty now
    scheduler.draining = draining
    commands = scheduler.handle(StepDone("b", 1, {"step_tokens": 30}))
    moves = [c for c in commands if isinstance(c, Move)]
    if draining:  # a drain waits for a step boundary of every task: nothing new starts, no move either
        assert not moves and scheduler.trainer_group("b") == 1
        return
    assert moves == [Move("b", 1, 0, 1)] and scheduler.trainer_group("b") == 0
    assert scheduler.trainers.placement.load == [30.0, 40.0]  # b's measured cost moved with it
    assert set(scheduler.trainers.moving) == {"b"} and not scheduler.settled()
    scheduler.handle(Moved("b", 0))
    assert not scheduler.trainers.moving
    following = _train_order(scheduler, commands, "b")
    assert following.trainer_group == 0 and following.from_version == 1
    record = scheduler.tasks["b"].checkpoint()
    assert record["trainer_group"] == 0 and record["moves"] == 1
