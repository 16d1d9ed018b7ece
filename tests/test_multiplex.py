"""Several base models on one rollout pool (issue #28): the scheduler's closed ranks, the model pool's policy, and
the policy under the simulator's clock (K jobs on shared ranks against dedicated ones)."""
import dataclasses
from functools import partial
from pathlib import Path

import pytest

from marlaas_hpc.config import JobConfig
from marlaas_hpc.scheduler import Generate, Generated, StepDone, Submit
from marlaas_hpc.scheduler.multiplex import (GENERATING, LOST, RELEASED, WAKING, Drain, ModelDemand, ModelPool,
                                              Reopen, Switch)
from marlaas_hpc.sim.setup import copies_to, setup_from_job
from marlaas_hpc.sim.workload import load_workload
from marlaas_hpc.tasks.spec import SpecError
from studies.multiplex import EngineSwitch, PoolJob, SharedPool, run_colocated, run_dedicated, run_shared
from support.checks import assert_pool_jobs_done
from support.configs import pool_scheduler as scheduler
from support.configs import task_spec
from support.workloads import gap_jobs

ROOT = Path(__file__).resolve().parents[1]
spec = partial(task_spec, batch=4)  # the multiplex tests' tasks: 4 prompts a step


def started(sched, task_id="t"):
    sched.handle(Submit(spec(task_id)))
    return sched.handle(StepDone(task_id, 0))


# ---------------------------------------------------------------- the scheduler's side: closed rollout ranks
def test_a_closed_rank_takes_no_new_groups_and_reopening_fills_it():
    sched = scheduler()
    sched.close_rollout_rank(2)
    commands = started(sched)
    assert {c.rollout_rank for c in commands if isinstance(c, Generate)} == {1}
    assert sched.pending_rollout() == 8 - 2, "(k+1)B = 8 groups allowed, rank 1's two slots taken"
    reopened = sched.open_rollout_rank(2)
    assert [(c.rollout_rank, len(c.groups)) for c in reopened] == [(2, 2)]
    assert sched.pending_rollout() == 4


def test_a_rank_closed_while_its_groups_run_is_not_refilled_when_they_end():
    sched = scheduler(ranks=(1,))
    generate = next(c for c in started(sched) if isinstance(c, Generate))
    sched.close_rollout_rank(1)
    assert sched.handle(Generated(1, tuple(g for g, _ in generate.groups))) == []
    assert sched.pending_rollout() == 6, "the generated groups are still outstanding (scoring)"


# ---------------------------------------------------------------- the policy alone
def demand(waiting=0, **held):
    return ModelDemand(waiting, {int(rank[1:]): n for rank, n in held.items()})


def test_an_idle_rank_switches_at_once_to_a_waiting_model():
    pool = ModelPool(2, ["a", "b"], switch_s=0.7, slots=4)
    out = pool.plan(10.0, {"a": demand(0, r0=0), "b": demand(6, r1=4)})
    assert out == [Switch(0, "a", "b", 10.7)]
    assert pool.serving("b") == [1], "the waking rank takes no groups until it is awake"
    pool.woken(0, 10.7)
    assert pool.serving("b") == [0, 1]


def test_affinity_a_model_keeps_its_rank_while_its_demand_lasts():
    pool = ModelPool(2, ["a", "b"], switch_s=0.7, slots=4)
    # a holds groups on its only rank: it is within its share, so b's waiting work does not take it
    assert pool.plan(100.0, {"a": demand(0, r0=3), "b": demand(20, r1=4)}) == []


def test_a_rank_over_its_models_share_drains_then_switches():
    pool = ModelPool(3, ["a", "b"], switch_s=0.7, slots=4)  # a: ranks 0 and 2, b: rank 1
    out = pool.plan(100.0, {"a": demand(0, r0=1, r2=3), "b": demand(40, r1=4)})
    assert out == [Drain(0, "a")], "the rank where a holds the fewest groups drains; none is cut off"
    assert pool.plan(101.0, {"a": demand(0, r0=1, r2=3), "b": demand(40, r1=4)}) == []
    assert pool.plan(102.0, {"a": demand(0, r0=0, r2=3), "b": demand(40, r1=4)}) == [Switch(0, "a", "b", 102.7)]


def test_a_drain_nobody_waits_for_any_more_is_called_off():
    pool = ModelPool(3, ["a", "b"], switch_s=0.7, slots=4)
    pool.plan(100.0, {"a": demand(0, r0=1, r2=3), "b": demand(40, r1=4)})
    assert pool.plan(101.0, {"a": demand(0, r0=1, r2=3), "b": demand(0, r1=4)}) == [Reopen(0, "a")]
    assert pool.serving("a") == [0, 2]


def test_no_switch_when_the_gain_is_below_the_switch_cost():
    pool = ModelPool(3, ["a", "b"], switch_s=5.0, slots=4)
    pool.observe("b", 1.0)  # b's groups hold a rank 1 s: one round of slots gains less than 2 x 5 s
    assert pool.plan(100.0, {"a": demand(0, r0=0, r2=3), "b": demand(40, r1=4)}) == []
    pool.switch_s = 0.1
    assert pool.plan(100.0, {"a": demand(0, r0=0, r2=3), "b": demand(40, r1=4)}) == [Switch(0, "a", "b", 100.1)]


def test_one_rank_rotates_between_models_after_its_dwell():
    pool = ModelPool(1, ["a", "b"], switch_s=0.5, slots=4)  # dwell 5 s
    busy = {"a": demand(4, r0=4), "b": demand(8)}
    assert pool.plan(4.0, busy) == []
    assert pool.plan(6.0, busy) == [Drain(0, "a")]
    assert pool.plan(7.0, {"a": demand(4, r0=0), "b": demand(8)}) == [Switch(0, "a", "b", 7.5)]


# ---------------------------------------------------------------- under the simulator's clock
def _jobs(search_tasks=2, gsm_tasks=2, ranks=1, staleness=0, steps=6):
    job = JobConfig.load(ROOT / "configs" / "sim-paper.yaml")
    workload = load_workload(ROOT / "configs" / "workloads" / "h100-qwen3-0.6b.yaml")
    gsm, search = job.tasks

    def setup(task, count):
        tasks = [dataclasses.replace(t, total_steps=steps, max_staleness=staleness) for t in copies_to([task], count)]
        return setup_from_job(job, tasks=tasks, rollout_ranks=ranks, env_ranks=2, trainer_tp=1, rollout_slots=32,
                              max_adapters=count)

    return [PoolJob(model="qwen3-0.6b", setup=setup(gsm, gsm_tasks), workload=workload),
            PoolJob(model="qwen3-0.6b-search", setup=setup(search, search_tasks), workload=workload)]


def test_two_models_on_one_rank_both_finish_within_their_bounds():
    jobs = _jobs()
    shared = run_shared(jobs, ranks=1)
    assert_pool_jobs_done(shared, jobs)
    assert shared.switches >= 2, "the rank went back and forth"
    assert all(seconds > 0 for seconds in shared.served_s.values())


def test_shared_pool_of_the_ranks_the_jobs_use_costs_fewer_gpu_hours_at_their_dedicated_speed():
    # each on-policy job (k = 0, two tasks) fills one rank's 32 slots: a dedicated pool of 2 ranks idles one
    jobs = _jobs(ranks=2)
    dedicated, shared = run_dedicated(jobs), run_shared(jobs, ranks=2)
    assert_pool_jobs_done(shared, jobs)
    for alone, together in zip(dedicated.jobs, shared.jobs):
        assert together.end_time <= 1.10 * alone.end_time
    assert shared.gpu_hours <= 0.9 * dedicated.gpu_hours


def test_a_dearer_switch_switches_less():
    jobs = _jobs()
    cheap = run_shared(jobs, ranks=1, switch=EngineSwitch(sleep=0.1, wake=0.1))
    dear = run_shared(jobs, ranks=1, switch=EngineSwitch(sleep=2.0, wake=8.0))
    assert_pool_jobs_done(dear, jobs)
    assert dear.switches < cheap.switches


def test_ranks_are_split_fairly_by_weight_and_unneeded_ranks_go_to_the_others():
    saturated = {"a": demand(100, r0=4, r2=4), "b": demand(100, r1=4, r3=4)}
    pool = ModelPool(4, ["a", "b"], switch_s=0.7, slots=4, weights={"a": 3.0, "b": 1.0})
    assert pool.plan(100.0, saturated) == [Drain(1, "b")], "a's weight is 3 of 4: b keeps one rank"
    even = ModelPool(4, ["a", "b"], switch_s=0.7, slots=4)
    assert even.plan(100.0, saturated) == [], "equal weights, both saturated: two ranks each, nothing moves"
    # a needs one rank (its 3 groups fill one rank's 4 slots): b, waiting, gets a's other one at once
    assert even.plan(100.0, {"a": demand(0, r0=3, r2=0), "b": demand(100, r1=4, r3=4)}) == [Switch(2, "a", "b", 100.7)]


def test_bench_prints_the_dedicated_and_shared_rows():
    import subprocess
    import sys

    args = ["--gsm-tasks", "1", "--search-tasks", "1", "--steps", "2", "--ranks", "1", "--pool", "2", "1",
            "--gap-steps", "2", "--gap-pool", "2", "1"]
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_multiplex.py"), *args], capture_output=True,
                         text=True, timeout=300, check=True).stdout
    lines = [line for line in out.splitlines() if line.startswith(("dedicated", "shared", "+", "cores"))]
    rows = [line for line in lines if line.count("|") > 2]
    assert [row.split("|")[0].strip() for row in rows] == [
        "dedicated 1+1", "dedicated coloc 1", "shared pool 2", "shared pool 1",  # the first workload
        "dedicated 1+1", "dedicated coloc 1"] + [  # the gap workload
        f"{policy} pool {size}" for policy in ("shared", "+release", "+gaps+release") for size in (2, 1)] + [
        "+trainers+release pool 2", "+trainers+gaps+rel pool 2",  # pool 1: no room for both trainer ranks
        "cores s=1 pool 2", "cores s=1 pool 1", "+trainers cores s=1 pool 2"]  # engines side by side
    assert all(row.split("|")[-2].strip() == "0" for row in rows), "no staleness violation"
    assert not any(" !" in row for row in rows), "every job finished"
    refused = [line for line in lines if line.count("|") == 1]
    assert [line.split("|")[0].strip() for line in refused] == ["+trainers+release pool 1", "+trainers+gaps+rel pool 1",
                                                               "+trainers cores s=1 pool 1"]
    assert all("one GPU per trainer rank" in line for line in refused)


def test_reopening_a_rank_lost_while_closed_is_skipped_and_an_unknown_rank_is_named():
    from marlaas_hpc.scheduler import RankLost

    sched = scheduler()
    started(sched)
    sched.close_rollout_rank(2)
    sched.handle(RankLost(2, "rollout"))
    assert sched.open_rollout_rank(2) == [], "a lost rank is not reopened (it was a KeyError)"
    assert sched.open_rollout_rank(2) == []
    with pytest.raises(ValueError, match="rank 7 is not a rollout rank of this scheduler"):
        sched.open_rollout_rank(7)
    with pytest.raises(ValueError, match="rank 7 is not a rollout rank of this scheduler"):
        sched.close_rollout_rank(7)


def test_a_lost_rank_leaves_the_split_and_measured_switches_set_the_cost_and_dwell():
    pool = ModelPool(3, ["a", "b"], switch_s=0.0, slots=4)  # a: ranks 0 and 2, b: rank 1
    pool.lose(1)
    # b waits with no rank: the lost rank 1 is not b's any more, so a live rank of a goes to b
    assert pool.plan(10.0, {"a": demand(0, r0=0, r2=4), "b": demand(8)}) == [Switch(0, "a", "b", 10.0)]
    assert pool.serving("b") == [] and pool.ranks[1].phase == "lost"
    pool.measured(0.2)
    pool.measured(0.4)
    assert pool.switch_s == pytest.approx(0.3) and pool.min_dwell_s == pytest.approx(3.0)


# ---------------------------------------------------------------- gaps inside episodes, and releasing ranks
def gap_demand(waiting=0, ready=None, **held_engine):
    """held_engine: r<rank>=(held, in engine)."""
    held = {int(r[1:]): n for r, (n, _) in held_engine.items()}
    engine = {int(r[1:]): e for r, (_, e) in held_engine.items()}
    return ModelDemand(waiting, held, engine, {int(r[1:]): n for r, n in (ready or {}).items()})


def test_fill_gaps_a_rank_whose_groups_all_wait_on_tools_serves_another_model_and_comes_back():
    demand_now = {"a": gap_demand(0, r0=(3, 0)), "b": gap_demand(8)}
    plain = ModelPool(1, ["a", "b"], switch_s=0.5, slots=4)
    assert plain.plan(1.0, demand_now) == [], "without fill_gaps: a holds groups (in tools) and is in its dwell"
    pool = ModelPool(1, ["a", "b"], switch_s=0.5, slots=4, fill_gaps=True)
    assert pool.plan(1.0, demand_now) == [Switch(0, "a", "b", 1.5)]
    pool.woken(0, 1.5)
    # a's sequences come back from their tools while b decodes: a waits for b's engine to empty
    busy_b = {"a": gap_demand(0, {"r0": 2}, r0=(3, 0)), "b": gap_demand(4, r0=(4, 4))}
    assert pool.plan(2.0, busy_b) == []
    # b's groups on the rank now all wait on their own tools: a's parked sequences get the rank back at once
    tools_b = {"a": gap_demand(0, {"r0": 2}, r0=(3, 0)), "b": gap_demand(4, r0=(4, 0))}
    assert pool.plan(2.5, tools_b) == [Switch(0, "b", "a", 3.0)]


def test_fill_gaps_leaves_a_rank_with_a_sequence_in_the_engine_and_a_drain_ends_once_the_engine_is_empty():
    pool = ModelPool(2, ["a", "b"], switch_s=0.5, slots=4, fill_gaps=True)  # a: rank 0, b: rank 1
    assert pool.plan(1.0, {"a": gap_demand(0, r0=(3, 1)), "b": gap_demand(8, r1=(4, 4))}) == []
    pool.ranks[0].phase, pool.ranks[0].to = "draining", "b"  # (a was over its share: the shares drained it)
    assert pool.plan(10.0, {"a": gap_demand(0, r0=(1, 1)), "b": gap_demand(8, r1=(4, 4))}) == []
    assert pool.plan(10.1, {"a": gap_demand(0, r0=(1, 0)), "b": gap_demand(8, r1=(4, 4))}) == [
        Switch(0, "a", "b", 10.6)], "a's last group waits on a tool: the drain ends without waiting for it"


def test_a_pool_releases_the_ranks_an_ended_job_would_have_had():
    pool = ModelPool(4, ["a", "b"], switch_s=0.5, slots=4, weights={"a": 2.0, "b": 2.0})  # a: 0, 2; b: 1, 3
    assert pool.release("a") == [0, 2]
    assert [s.phase for s in pool.ranks] == ["released", "generating", "released", "generating"]
    assert pool.plan(10.0, {"a": demand(0), "b": demand(100, r1=4, r3=4)}) == [], "released ranks serve no one"
    assert pool.release("b") == [], "the last job keeps its ranks until it ends"


def test_under_the_simulator_filling_tool_gaps_serves_the_other_job_sooner_and_reprefills_the_parked():
    jobs = gap_jobs()
    plain, gaps = run_shared(jobs, ranks=1), run_shared(jobs, ranks=1, fill_gaps=True)
    assert_pool_jobs_done(gaps, jobs)
    assert plain.reprefill_tokens == 0 and gaps.reprefill_tokens > 0, "parked contexts are prefilled again"
    assert gaps.jobs[0].end_time < plain.jobs[0].end_time, "the GSM8K job runs in the search job's tool waits"


def test_under_the_simulator_a_released_rank_stops_counting_when_its_job_ends():
    jobs = gap_jobs()
    dedicated = run_dedicated(jobs)
    kept, released = run_shared(jobs, ranks=2), run_shared(jobs, ranks=2, release=True)
    assert_pool_jobs_done(released, jobs)
    assert released.gpu_hours < kept.gpu_hours
    assert released.gpu_hours == pytest.approx(dedicated.gpu_hours, rel=0.02), "no sharing needed: as dedicated"


# ---------------------------------------------------------------- trainers in the pool (layout.share_gpus)
def test_pooled_trainer_work_takes_its_gpu_in_turn_and_a_switch_waits_for_it():
    pool = SharedPool(gap_jobs(), 2, EngineSwitch(sleep=0.2, wake=0.5), seed=0, tick_s=0.05, trainers_in_pool=True)
    assert pool.trainer_gpus == {"A-gsm8k": [(0,)], "B-websearch": [(1,)]}, "one trainer rank per GPU, from the front"
    assert pool.occupy(0, 5.0, "train") == 5.0
    assert pool.occupy(0, 2.0, "train") == 7.0, "the second step waits for the first"
    assert pool.occupy(1, 1.0, "train") == 1.0, "another GPU is free"
    pool._apply(Switch(0, "A-gsm8k", "B-websearch", 0.7))
    assert pool.engines[0]["B-websearch"].stall_until == pytest.approx(7.7), "the wake starts after the steps"


def test_trainers_in_the_pool_count_no_gpu_of_their_own_and_pause_the_engines_they_share():
    jobs = _jobs(ranks=1, staleness=1)  # async: the engines decode while a step trains
    apart, pooled = run_shared(jobs, ranks=2), run_shared(jobs, ranks=2, trainers_in_pool=True)
    assert_pool_jobs_done(pooled, jobs)
    assert (apart.gpus, pooled.gpus) == (4, 2)
    assert all(p.end_time > a.end_time for p, a in zip(pooled.jobs, apart.jobs)), "each step pauses decoding"


def test_trainers_need_a_gpu_each_and_a_rank_whose_trainer_still_runs_is_never_released():
    with pytest.raises(SpecError, match="one GPU per trainer rank"):
        run_shared(gap_jobs(), ranks=1, trainers_in_pool=True)
    assert ModelPool(2, ["a", "b"], switch_s=0.5, slots=4).release("a") == [0]
    assert ModelPool(2, ["a", "b"], switch_s=0.5, slots=4).release("a", pinned={0}) == []


def test_on_policy_jobs_with_trainers_in_the_pool_halve_the_gpu_hours_as_colocated_jobs_do():
    jobs = gap_jobs()
    dedicated, colocated = run_dedicated(jobs), run_colocated(jobs)
    pooled = run_shared(jobs, ranks=2, release=True, trainers_in_pool=True)
    assert_pool_jobs_done(pooled, jobs)
    for alone, together in zip(dedicated.jobs, pooled.jobs):
        assert together.end_time <= 1.10 * alone.end_time
    assert pooled.gpu_hours <= 0.55 * dedicated.gpu_hours, "the trainer GPUs' idle time is gone"
    assert pooled.gpu_hours == pytest.approx(colocated.gpu_hours, rel=0.02), "each job alone on its GPU does as well"


def test_a_rank_that_joins_serves_the_model_most_in_need_then_is_a_donor_like_the_others():
    """ModelPool.join (a rank added to a running job, issue #28 with `marlaas scale`): it enters the split under a
    new index, for the model with the most waiting groups, switching first when the engine awake on it is
    another's; later, over its model's share, it is the rank handed to the model that waits."""
    pool = ModelPool(1, ["a", "b"], switch_s=0.5, slots=4, min_dwell_s=2.0)
    assert pool.ranks[0].awake == "a"
    # t=10: rank 0 is full of a's groups, b waits for 8: the joiner (a awake, as a joiner comes up) goes to b
    joined = pool.join(10.0, {"a": demand(2, r0=4), "b": demand(8)}, awake="a")
    assert joined == 1 and (pool.ranks[1].awake, pool.ranks[1].phase, pool.ranks[1].until) == ("b", WAKING, 10.5)
    assert pool.switches == 1 and pool.serving("b") == []
    pool.woken(1, 10.5)
    assert pool.serving("b") == [1] and pool._counts() == {"a": 1, "b": 1}
    # within its dwell, b's work on it goes on: nothing moves
    assert pool.plan(11.0, {"a": demand(6, r0=4), "b": demand(0, r1=4)}) == []
    # t=13: b's work ended, a waits for 6 groups: the joiner is the donor (it holds nothing: a switch at once)
    assert pool.plan(13.0, {"a": demand(6, r0=4), "b": demand(0, r1=0)}) == [Switch(1, "b", "a", 13.5)]
    # a second joiner while nobody waits serves its awake engine's model at once (no switch)
    assert pool.join(14.0, {"a": demand(0, r0=4), "b": demand(0)}, awake="a") == 2
    assert (pool.ranks[2].awake, pool.ranks[2].phase, pool.switches) == ("a", GENERATING, 2)
    # a rank given back (scale down) leaves the split like a lost one; a lost rank's index is never reused
    pool.leave(2)
    pool.lose(0)
    assert [s.phase for s in pool.ranks] == [LOST, WAKING, RELEASED]
    assert pool.join(15.0, {"a": demand(0), "b": demand(3)}, awake="a") == 3 and pool.ranks[3].awake == "b"
    pool.woken(1, 15.0)
    assert pool._counts() == {"a": 1, "b": 1}
