"""Rank losses and joins as scheduler events (RankLost / RankJoined): the pure scheduler, driven by SimLoop with
injected failures. A lost rollout or env rank's unscored groups are issued again to the survivors under fresh
ids; every task still finishes, every step trains exactly B groups within the bound, no prompt is trained twice,
and nothing of a lost group is ever trained."""
import collections

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from marlaas_hpc.scheduler import (DONE, Generate, Generated, RankJoined, RankLeaving, RankLost, Scheduler,
                                   SchedulerConfig, Scored, StepDone, Submit)
from support.configs import task_spec as spec
from support.simloop import SimLoop
from support.workloads import RandomDurations


def _loop(specs, rollout=(1, 2), env=(10, 11), seed=0, slots=3):
    loop = SimLoop.__new__(SimLoop)
    config = SchedulerConfig(rollout_ranks=tuple(rollout), env_ranks=tuple(env), rollout_slots=slots, max_adapters=8)
    scheduler = Scheduler(config, clock=lambda: loop.now)
    SimLoop.__init__(loop, scheduler, RandomDurations(seed), delivery_jitter=0.05, seed=seed)
    for s in specs:
        loop.submit(s)
    return scheduler, loop


def _check_exact(scheduler, result, specs):
    assert result.ended == {s.task_id: DONE for s in specs}, "every task finishes on the survivors"
    discarded = set(result.discarded)
    for s in specs:
        records = [r for r in scheduler.audit if r.task_id == s.task_id]
        per_version = collections.Counter(r.trained_into for r in records)
        assert per_version == {v: s.algo.batch_prompts for v in range(1, s.total_steps + 1)}
        prompts = [r.group_id.split("/g")[1].split(".r")[0] for r in records]
        assert len(prompts) == len(set(prompts)), "no prompt is trained twice"
        assert not discarded & {r.group_id for r in records}, "nothing of a lost group is trained"
        for r in records:
            assert r.trained_into - 1 - s.max_staleness <= r.behaviour_version <= r.trained_into - 1


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), role=st.sampled_from(["rollout", "env"]), at=st.floats(0.0, 8.0),
       bounds=st.lists(st.integers(0, 3), min_size=1, max_size=3))
def test_property_a_lost_worker_rank_loses_no_step_and_trains_nothing_twice(seed, role, at, bounds):
    specs = [spec(f"t{i}", k, steps=6, batch=2) for i, k in enumerate(bounds)]
    scheduler, loop = _loop(specs, seed=seed)
    loop.lose(2 if role == "rollout" else 11, role, at)
    result = loop.run()
    _check_exact(scheduler, result, specs)
    survivor = 1 if role == "rollout" else 10
    assert set(scheduler.rollout_load if role == "rollout" else scheduler.env_load) == {survivor}


@pytest.mark.parametrize("role, rank", [("rollout", 2), ("env", 11)])
def test_a_loss_mid_run_reissues_groups(role, rank):
    specs = [spec("a", 1, steps=8, batch=2), spec("b", 0, steps=8, batch=2)]
    scheduler, loop = _loop(specs, seed=3)
    loop.lose(rank, role, at=2.0)
    result = loop.run()
    _check_exact(scheduler, result, specs)
    reissued = sum(t.reissued_groups for t in scheduler.tasks.values())
    assert reissued > 0 and result.lost_events > 0 and len(result.discarded) >= reissued
    assert any(".r1" in r.group_id for r in scheduler.audit), "a group issued again is trained"


def test_groups_of_a_lost_rollout_rank_go_to_the_survivor_under_fresh_ids():
    scheduler = Scheduler(SchedulerConfig(rollout_ranks=(1, 2), env_ranks=(10,), rollout_slots=2), clock=lambda: 0.0)
    scheduler.handle(Submit(spec("a", 1, steps=3, batch=2)))
    out = scheduler.handle(StepDone("a", 0))
    on_two = [g for c in out if isinstance(c, Generate) and c.rollout_rank == 2 for g in c.groups]
    assert on_two, out
    out = scheduler.handle(RankLost(2, "rollout"))
    discard = [c for c in out if type(c).__name__ == "Discard"]
    assert discard and set(discard[0].group_ids) == {gid for gid, _ in on_two}
    again = [c for c in out if isinstance(c, Generate)]
    # the survivor is full (2 slots): the prompts wait for its slots, then come out first, under fresh ids
    assert not again and scheduler.tasks["a"].reissue == sorted(p for _, p in on_two)
    freed = scheduler.handle(Generated(1, ("a/g0",)))
    issued = [g for c in freed if isinstance(c, Generate) for g in c.groups]
    assert issued and all(c.rollout_rank == 1 for c in freed if isinstance(c, Generate))
    assert issued[0] == (f"a/g{on_two[0][1]}.r1", on_two[0][1])


def test_late_events_of_a_lost_rank_change_nothing():
    scheduler = Scheduler(SchedulerConfig(rollout_ranks=(1, 2), env_ranks=(10, 11), rollout_slots=1),
                          clock=lambda: 0.0)
    scheduler.handle(Submit(spec("a", 1, steps=3, batch=2)))
    out = scheduler.handle(StepDone("a", 0))
    lost = next(c for c in out if isinstance(c, Generate) and c.rollout_rank == 2)
    scheduler.handle(RankLost(2, "rollout"))
    load = dict(scheduler.rollout_load)
    scheduler.handle(Generated(2, (lost.groups[0][0],)))  # sent just before it died
    scheduler.handle(Scored(lost.groups[0][0], 1.0))
    assert scheduler.rollout_load == load and 2 not in scheduler.rollout_load
    assert not scheduler.tasks["a"].ready, "a lost group's late Scored is not trained"


def test_a_joined_rollout_rank_takes_groups():
    scheduler, loop = _loop([spec("a", 1, steps=8, batch=2), spec("b", 2, steps=8, batch=2)], rollout=(1,),
                            env=(10,), slots=1)
    loop.join(7, at=1.0)
    result = loop.run()
    assert result.ended == {"a": DONE, "b": DONE}
    assert 7 in scheduler.rollout_load and scheduler.rollout_ranks == [1, 7]
    with pytest.raises(ValueError, match="already known"):
        scheduler.handle(RankJoined(7))


def test_a_draining_rollout_rank_gets_no_new_group_and_is_idle_once_its_groups_are_done():
    """`marlaas scale` down: RankLeaving keeps new groups off the rank; what it holds finishes there (no group is
    issued again), and `rank_idle` says when it may leave."""
    scheduler = Scheduler(SchedulerConfig(rollout_ranks=(1, 2), env_ranks=(10,), rollout_slots=2), clock=lambda: 0.0)
    scheduler.handle(Submit(spec("a", 1, steps=4, batch=4)))
    out = scheduler.handle(StepDone("a", 0))
    on_two = [g for c in out if isinstance(c, Generate) and c.rollout_rank == 2 for g, _ in c.groups]
    assert on_two and not scheduler.rank_idle(2)
    assert scheduler.handle(RankLeaving(2)) == [], "nothing is issued again: its groups finish where they are"
    for group_id in on_two:
        out = scheduler.handle(Generated(2, (group_id,)))
        assert all(c.rollout_rank != 2 for c in out if isinstance(c, Generate)), "no new group on a draining rank"
        assert not scheduler.rank_idle(2), "a generated group is still being scored"
        scheduler.handle(Scored(group_id, 1.0))
    assert scheduler.rank_idle(2) and not scheduler.rank_idle(1)
    scheduler.handle(RankLost(2, "rollout"))  # it leaves: nothing of it is left to issue again
    assert scheduler.tasks["a"].reissued_groups == 0 and not scheduler.tasks["a"].reissue


def test_losing_every_env_rank_issues_nothing_more():
    scheduler = Scheduler(SchedulerConfig(rollout_ranks=(1,), env_ranks=(10,), rollout_slots=2), clock=lambda: 0.0)
    scheduler.handle(Submit(spec("a", 1, steps=3, batch=2)))
    scheduler.handle(StepDone("a", 0))
    out = scheduler.handle(RankLost(10, "env"))
    assert not [c for c in out if isinstance(c, Generate)]
    for group_id in ("a/g0", "a/g1"):  # the rollout rank goes on, but no group has an env rank to go to
        assert not [c for c in scheduler.handle(Generated(1, (group_id,))) if isinstance(c, Generate)]


def _groups_loop(specs, seed):
    loop = SimLoop.__new__(SimLoop)
    config = SchedulerConfig(rollout_ranks=(1, 2), env_ranks=(10,), rollout_slots=3, max_adapters=8,
                             trainer_groups=2)
    scheduler = Scheduler(config, clock=lambda: loop.now)
    SimLoop.__init__(loop, scheduler, RandomDurations(seed), delivery_jitter=0.05, seed=seed)
    for s in specs:
        loop.submit(s)
    return scheduler, loop


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), at=st.floats(0.5, 10.0))
def test_property_a_lost_trainer_group_rolls_back_its_own_tasks_only(seed, at):
    """Trainer group 1 lost at a random time: its tasks (or one moving out of it) go back to their checkpoint and
    finish on group 0; the audit keeps every version once; a task group 1 never owned is never rolled back."""
    specs = [spec(f"t{i}", i % 3, steps=6, batch=2) for i in range(4)]
    scheduler, loop = _groups_loop(specs, seed)
    loop.lose_trainer_group(1, at)
    owners: dict[str, set] = collections.defaultdict(set)
    handle = scheduler.handle

    def watching(event):  # which groups owned each task before the loss
        out = handle(event)
        if loop.now < at:
            for task in scheduler.tasks.values():
                owners[task.task_id].add(task.trainer_group)
                owners[task.task_id].add(scheduler.trainers.moving.get(task.task_id))
        return out

    scheduler.handle = watching
    result = loop.run()
    _check_exact(scheduler, result, specs)
    for task in scheduler.tasks.values():
        if 1 not in owners[task.task_id]:
            assert task.rollbacks == 0, f"{task.task_id} never on group 1 went back to a checkpoint"
        assert task.trainer_group == 0 or task.rollbacks == 0
    assert 1 in scheduler.trainers.lost


def test_a_rolled_back_task_is_admitted_again_at_its_checkpoint_under_a_new_adapter_line():
    scheduler = Scheduler(SchedulerConfig(rollout_ranks=(1,), env_ranks=(10,), rollout_slots=4, trainer_groups=2),
                          clock=lambda: 0.0)
    out = scheduler.handle(Submit(spec("a", 1, steps=5, batch=2)))
    admit = next(c for c in out if type(c).__name__ == "Admit")
    group = admit.trainer_group
    saved = scheduler.tasks["a"].checkpoint()  # its record at submission: never saved since
    scheduler.handle(StepDone("a", 0))
    issued = scheduler.tasks["a"].next_prompt
    assert issued > 0
    out = scheduler.handle(RankLost(99, "trainer", group, {"a": saved}))
    task = scheduler.tasks["a"]
    again = next(c for c in out if type(c).__name__ == "Admit")
    assert again.trainer_group != group and again.resume_version is None and again.adapter_key == "a@1"
    assert task.reissue == list(range(issued)) and task.version == -1 and task.adapter_key == "a@1"
    assert any(type(c).__name__ == "Discard" for c in out)
    assert scheduler.handle(RankLost(98, "trainer", group, {})) == [], "one loss per group"
