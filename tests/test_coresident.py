"""Engines of several models resident side by side on one GPU, all awake (tools/studies/coresident.py, issue #28): the
interference model's arithmetic, jobs that do not interfere running as alone, ranks given back as jobs end,
pooled trainer steps pausing every engine of their GPU."""
import pytest

from marlaas_hpc.sim.engine import Sequence, SimGroup
from marlaas_hpc.sim.workload import Distribution, TaskProfile
from marlaas_hpc.tasks.spec import SpecError
from studies.coresident import CoresidentPool, run_coresident
from studies.multiplex import run_dedicated, run_shared
from support.checks import assert_pool_jobs_done
from support.workloads import gap_jobs


def _one_gpu(interference: float):
    pool = CoresidentPool(gap_jobs(), 1, seed=0, interference=interference, trainers_in_pool=False,
                          release=False, tick_s=0.05)
    return pool, pool.engines[0]["A-gsm8k"], pool.engines[0]["B-websearch"]


def _decode(engine, tokens: int, done: list) -> None:
    """One sequence of exactly `tokens` tokens enters `engine`; its completion time goes to `done`."""
    profile = TaskProfile(response_tokens=Distribution(value=float(tokens)))
    group = SimGroup("t", f"{engine.rank}-{tokens}", 0, 1, profile, max_tokens=10_000, sequences_left=1)
    engine._turn_done = lambda sequence, name=group.group_id: done.append((name, engine.sim.queue.now))
    engine._enter(Sequence(group, 1))
    engine._schedule()


@pytest.mark.parametrize("interference", [1.0, 0.5, 0.0])
def test_an_engine_step_waits_for_its_neighbours_steps_and_speeds_up_when_they_end(interference):
    """B decodes 50 tokens, A 100, from t=0 on one GPU, batch 1 each: a step of either takes decode_step
    (4 ms) + s x the other's 4 ms + 0.3 ms overhead while both run; once B ends, A's rate goes back to 4.3 ms a
    token at once (its completion is filed again, not left where the slower rate had put it)."""
    pool, a, b = _one_gpu(interference)
    done: list = []
    _decode(b, 50, done)
    _decode(a, 100, done)  # filed at the shared rate: B's end must move it sooner
    pool.queue.run(until_idle=lambda: False)
    step, overhead = a.model.decode_step, a.model.step_overhead
    both = step * (1 + interference) + overhead
    b_end = 50 * both
    a_end = b_end + 50 * (step + overhead)
    assert [name for name, _ in done] == [f"{b.rank}-50", f"{a.rank}-100"]
    assert [when for _, when in done] == pytest.approx([b_end, a_end], rel=1e-9)


def test_without_interference_each_job_runs_as_alone_and_with_it_the_shared_gpu_slows_them():
    jobs = gap_jobs()
    dedicated = run_dedicated(jobs)
    apart = run_coresident(jobs, 1, interference=0.0)
    together = run_coresident(jobs, 1, interference=1.0)
    assert_pool_jobs_done(apart, jobs)
    assert_pool_jobs_done(together, jobs)
    assert [j.end_time for j in apart.jobs] == pytest.approx([j.end_time for j in dedicated.jobs], rel=1e-9)
    assert together.jobs[0].end_time > 1.2 * apart.jobs[0].end_time, "the GSM8K job decodes beside the agent's"
    # the agent's rounds wait on tool calls mostly; its draws come in another order, so it may end a little sooner
    assert together.jobs[1].end_time == pytest.approx(apart.jobs[1].end_time, rel=0.05)
    assert apart.switches == together.switches == 0


def test_a_pool_of_the_dedicated_size_gives_back_the_ended_job_s_emptiest_gpu():
    """Each job starts on its own GPU; when the GSM8K job ends, its GPU (no group of the agent there) is given
    back, not the agent's: GPU-hours as the dedicated pools', no job slower."""
    jobs = gap_jobs()
    dedicated = run_dedicated(jobs)
    kept, released = run_coresident(jobs, 2), run_coresident(jobs, 2, release=True)
    assert_pool_jobs_done(released, jobs)
    assert released.gpu_hours < kept.gpu_hours
    assert released.gpu_hours == pytest.approx(dedicated.gpu_hours, rel=0.01)
    for alone, shared in zip(dedicated.jobs, released.jobs):
        assert shared.end_time == pytest.approx(alone.end_time, rel=0.01)
    pool = CoresidentPool(jobs, 2, seed=0, interference=1.0, trainers_in_pool=False, release=True, tick_s=0.05)
    pool.run(1e6)
    assert list(pool.released_at) == [0], "GPU 0, where the GSM8K job started, not the agent's GPU 1"


def test_a_pooled_trainer_step_pauses_every_engine_on_its_gpu_and_bad_interference_is_refused():
    pool = CoresidentPool(gap_jobs(), 2, seed=0, interference=1.0, trainers_in_pool=True, release=False,
                          tick_s=0.05)
    assert pool.occupy(0, 5.0, "train") == 5.0
    assert pool.occupy(0, 2.0, "train") == 7.0, "the second step waits for the first"
    assert [engine.stall_until for engine in pool.engines[0].values()] == [7.0, 7.0]
    assert [engine.stall_until for engine in pool.engines[1].values()] == [0.0, 0.0]
    with pytest.raises(SpecError, match="interference"):
        run_coresident(gap_jobs(), 1, interference=1.5)
    with pytest.raises(SpecError, match="one GPU per trainer rank"):
        run_coresident(gap_jobs(), 1, trainers_in_pool=True)


def test_coresident_engines_need_no_switch_where_time_slicing_switches():
    jobs = gap_jobs()
    sliced, resident = run_shared(jobs, ranks=1), run_coresident(jobs, 1)
    assert_pool_jobs_done(resident, jobs)
    assert sliced.switches > 0 and resident.switches == 0
    assert resident.jobs[0].end_time < sliced.jobs[0].end_time, "GSM8K decodes in the agent's gaps at once"


def test_the_interference_bench_times_each_engine_alone_and_beside_the_other():
    """tools/bench_coresident.py, the measurement of `interference` for a GPU session: two hf engines here (on
    this CPU the figure itself means nothing); s = (time beside the other - time alone) / the other's time alone."""
    import math
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root / "tools"))
    from bench_coresident import interference

    times = {(8, "A alone", "A"): 1.0, (8, "B alone", "B"): 2.0, (8, "both", "A"): 2.0, (8, "both", "B"): 2.5}
    assert interference(times, 8) == (0.5, 0.5)
    out = subprocess.run([sys.executable, str(root / "tools" / "bench_coresident.py"), "--engine", "hf", "--batch",
                          "1", "4", "--new-tokens", "4"], capture_output=True, text=True, timeout=300, check=True)
    rows = [line.split("|") for line in out.stdout.splitlines() if line.strip().split("|")[0].strip().isdigit()]
    assert [int(row[0]) for row in rows] == [1, 4]
    assert all(float(cell) > 0 for row in rows for cell in row[1:5]), out.stdout
    assert all(math.isfinite(float(cell)) for row in rows for cell in row[5:]), out.stdout
    assert "Traceback" not in out.stderr and "Loading weights" not in out.stderr, out.stderr[-2000:]
