"""Issue #29 in the simulator: the delta plane's lockstep broadcast against a relay tier (sim/weight_sync.py), and
what long tails cost (tools/studies/tails.py) on constructed cases whose answer is worked out by hand."""
import dataclasses
import sys
from pathlib import Path

import pytest

from marlaas_hpc.config import JobConfig
from marlaas_hpc.config_loader import SpecError
from marlaas_hpc.sim.engine import Simulation
from marlaas_hpc.sim.report import staleness_violations
from marlaas_hpc.sim.setup import setup_from_job
from marlaas_hpc.sim.weight_sync import DeltaPlaneModel
from marlaas_hpc.sim.workload import load_workload
from studies.tails import OccupancyRolloutSim, tail_costs

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
from bench_laminar import WORKLOAD, heavy_tail_setup  # noqa: E402


def run_plane(plane: str, ranks: int, max_in_flight: int = 16) -> Simulation:
    """Four tasks per rollout rank (the same load per rank at every size), two steps each."""
    sim = Simulation(heavy_tail_setup(4 * ranks, ranks, steps=2), load_workload(WORKLOAD), seed=0, trace=False,
                     delta_plane=DeltaPlaneModel(plane=plane, max_in_flight=max_in_flight))
    outcome = sim.run()
    assert set(outcome.ended.values()) == {"done"}
    return sim


def test_lockstep_blocks_the_leader_longer_as_rollout_ranks_grow_the_relay_does_not():
    """A leader that waits for its broadcast (max_in_flight 0) waits for the slowest of R ranks to end its engine
    step, behind every broadcast before it in the job's order: more ranks, longer. A relay push does not see the
    rollout ranks at all."""
    lockstep = [run_plane("broadcast", r, max_in_flight=0).delta_plane.meter.blocked_per_update() for r in (1, 16, 64)]
    relay = [run_plane("relay", r).delta_plane.meter.blocked_per_update() for r in (1, 16, 64)]
    assert lockstep[0] < lockstep[1] < lockstep[2]
    assert lockstep[2] > 3 * lockstep[0]
    assert max(relay) == pytest.approx(min(relay), rel=1e-6)
    assert relay[2] < lockstep[2] / 3


def test_lockstep_costs_each_rollout_rank_more_per_update_as_ranks_grow_the_relay_does_not():
    """Today's leader posts and returns (16 in flight), so the lockstep's price moves to the rollout ranks: each
    waits in every broadcast for the slowest one to end its step. A relay pull costs a rank its own transfer and
    install only. (Past ~16 ranks broadcasts queue up, and a rank still in the previous one joins the next at once:
    the cost then shows as rollout time spent on the plane, not per broadcast.)"""
    lockstep = [run_plane("broadcast", r).delta_plane.meter.rank_seconds_per_update() for r in (1, 4, 16)]
    relay = [run_plane("relay", r).delta_plane.meter.rank_seconds_per_update() for r in (1, 4, 16)]
    assert lockstep[0] < lockstep[1] < lockstep[2]
    assert lockstep[2] > 1.5 * lockstep[0]
    assert max(relay) < 1.05 * min(relay)
    assert relay[2] < lockstep[2] / 1.5


class Scripted:
    """Completion lengths in a fixed order (a constructed case), one per sequence entering the engine."""

    def __init__(self, lengths):
        self.lengths = list(lengths)

    def sample(self, rng) -> float:
        return self.lengths.pop(0) if self.lengths else 5.0


def scripted_sim(lengths, *, group_size: int, steps: int, slots: int, max_running: int = 256, rollout_ranks: int = 1,
                 engine=OccupancyRolloutSim) -> Simulation:
    """One single-turn task (B 1, staleness bound 1) on one rollout rank, its completion lengths scripted."""
    job = JobConfig.load(ROOT / "configs" / "sim-paper.yaml")
    task = next(t for t in job.tasks if t.task_id == "gsm8k")
    task = dataclasses.replace(task, total_steps=steps, max_staleness=1,
                               algo=dataclasses.replace(task.algo, group_size=group_size, batch_prompts=1))
    setup = setup_from_job(job, tasks=[task], max_adapters=1, rollout_ranks=rollout_ranks, env_ranks=1,
                           trainer_tp=1, rollout_slots=slots)
    workload = load_workload(WORKLOAD)
    lengths = lengths if hasattr(lengths, "sample") else Scripted(lengths)
    profile = dataclasses.replace(workload.profiles["default"], response_tokens=lengths)
    workload = dataclasses.replace(workload, profiles={"default": profile},
                                   rollout=dataclasses.replace(workload.rollout, max_running_sequences=max_running,
                                                               prefill_per_token=0.0))
    return Simulation(setup, workload, seed=0, trace=False, rollout_engine=engine)


def test_a_group_overtaken_past_the_bound_is_counted_dropped():
    """B 1, bound 1, two groups in flight: g0 is long (2000 tokens, ~9 s), every later group 5 tokens. g1 trains
    v0 -> v1, g2 (issued at v1) trains v1 -> v2, ... so when g0 is scored the task is far past v1 and g0 (behaviour
    version 0) is below the oldest allowed: exactly one group, G samples, dropped; every other one trained."""
    sim = scripted_sim([2000.0] * 2, group_size=2, steps=30, slots=2)
    outcome = sim.run()
    assert outcome.ended == {"gsm8k": "done"}
    costs = tail_costs(sim)
    assert (costs.dropped_groups, costs.dropped_samples) == (1, 2)
    assert costs.trained_groups == 30
    assert costs.issued_groups == costs.trained_groups + costs.dropped_groups


def test_decode_time_with_few_sequences_is_measured():
    """One group of 4 sequences, lengths 100, 10, 10, 10, on an engine of 4 slots: 10 steps at 4 running, then 90
    at 1. With sparse meaning under half the slots (2), the sparse share is 90 step(1) / (10 step(4) + 90 step(1))."""
    sim = scripted_sim([100.0, 10.0, 10.0, 10.0], group_size=4, steps=1, slots=1, max_running=4)
    sim.run()
    rollout = sim.workload.rollout
    step = [rollout.decode_step * n ** rollout.batch_exponent + rollout.step_overhead for n in (1, 4)]
    costs = tail_costs(sim, sparse_share=0.5)
    assert costs.sparse_below == 2
    assert costs.decode_seconds == pytest.approx(10 * step[1] + 90 * step[0], rel=1e-6)
    assert costs.sparse_fraction == pytest.approx(90 * step[0] / (10 * step[1] + 90 * step[0]), rel=1e-6)


@pytest.mark.parametrize("field, value, message", [
    ("plane", "gossip", "delta_plane.plane: must be one of ['broadcast', 'relay']"),
    ("max_in_flight", -1, "delta_plane.max_in_flight: must be an integer >= 0"),
    ("relay_fanout", 0, "delta_plane.relay_fanout: must be an integer >= 1"),
    ("pull_bandwidth", 0.0, "delta_plane.pull_bandwidth: must be a number of bytes/s > 0"),
    ("relay_latency", -1e-6, "delta_plane.relay_latency: must be a number of seconds >= 0"),
])
def test_a_bad_delta_plane_is_refused_naming_the_field(field, value, message):
    with pytest.raises(SpecError) as error:
        DeltaPlaneModel(**{field: value}).validate()
    assert message in str(error.value)


def test_relay_on_demand_pulls_only_what_work_asks_for_within_the_bound():
    """Pulling on demand, a rank installs a task's version only when work for it waits on one: fewer installs
    than pulling every version, and the staleness rule holds (work never starts on an older version than asked)."""
    eager, on_demand = (Simulation(heavy_tail_setup(64, 16, steps=2), load_workload(WORKLOAD), seed=0, trace=False,
                                   delta_plane=DeltaPlaneModel(plane="relay", relay_pull=pull))
                        for pull in ("eager", "on_demand"))
    for sim in (eager, on_demand):
        assert set(sim.run().ended.values()) == {"done"}
        assert not staleness_violations(sim)
    spent = [sum(sim.delta_plane.meter.rank_seconds.values()) for sim in (eager, on_demand)]
    assert spent[1] < spent[0] / 2


class ScriptedLognormal(Scripted):
    """Scripted lengths whose kind claims a log-normal of the given median and sigma (its p90 for the repack)."""

    dist = "lognormal"

    def __init__(self, lengths, median: float, sigma: float):
        super().__init__(lengths)
        self.median, self.sigma = median, sigma


def test_a_repacked_sequence_continues_on_the_tail_rank_where_it_left_off():
    """One group of 4 on a 4-slot engine, lengths 300, 10, 10, 10; the kind's p90 is 10 e^(1.28 * 0.5) = 18.96
    tokens. After 10 steps at 4 running, the long one runs alone (under the share, set to half: 2 of 4 slots);
    past its p90 (19 tokens generated) it moves to the tail rank, which re-prefills it and decodes the other 281.
    Decoded tokens are conserved: 10 steps at 4 and 290 at 1, over both ranks; the group is scored and trained
    once, from the tail rank."""
    from studies.repack import RepackingRolloutSim, with_tail_ranks

    lengths = ScriptedLognormal([300.0, 10.0, 10.0, 10.0], median=10.0, sigma=0.5)
    sim = scripted_sim(lengths, group_size=4, steps=1, slots=1, max_running=4, rollout_ranks=2,
                       engine=RepackingRolloutSim)
    with_tail_ranks(sim, 1, share=0.5)
    assert sim.run().ended == {"gsm8k": "done"}
    regular, tail = (sim.rollout[rank] for rank in sorted(sim.rollout))
    assert (regular.repacked_sequences, tail.repacked_sequences) == (1, 0)
    rollout = sim.workload.rollout
    step = {n: rollout.decode_step * n ** rollout.batch_exponent + rollout.step_overhead for n in (1, 4)}
    assert regular.occupancy[4] == pytest.approx(10 * step[4])
    assert regular.occupancy[1] == pytest.approx(9 * step[1])
    assert tail.occupancy[1] == pytest.approx(281 * step[1])
    task = sim.scheduler.tasks["gsm8k"]
    assert (task.trained_groups, task.dropped_groups, task.version) == (1, 0, 1)
