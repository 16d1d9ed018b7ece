"""Env pool I/O lane: steps that wait on a service (the lookup tool) run many at once, not one per worker,
bounded per tool by env_pool.tool_concurrency; a cheap reward of another task does not queue behind them; the
step timeout still applies. Concurrency is what the lookup service itself saw (`Lookup.most_waiting`)."""
import threading

import pytest

from marlaas_hpc.env import EnvPool, EnvPoolConfig, LookupTask, ToolEnv, environment_for
from marlaas_hpc.tasks import DatasetSpec
from marlaas_hpc.tasks.synthetic import SyntheticTask

WORKERS = 2


def lookup_task(latency_s: float, syntax: str = "compact", seed: int = 0) -> LookupTask:
    return LookupTask(DatasetSpec(kind="lookup", eval_size=4, seed=seed, tool_latency_s=latency_s), syntax=syntax)


def lookup_service(task: LookupTask):
    return task.tools.tools["lookup"]


def submit_lookups(pool: EnvPool, key: str, task: LookupTask, n: int) -> list:
    """n episodes' first turns ('?': look the prompt's key up), each on its own env."""
    futures = []
    for i in range(n):
        env = environment_for(task)
        env.reset(task.train_sample(i))
        futures.append((pool.submit(key, env, "?"), env.sample))
    return futures


def check_observations(futures) -> None:
    for future, sample in futures:
        outcome = future.result(timeout=120)
        assert outcome.error is None and outcome.io, outcome.error
        value = sample.meta["table"][sample.meta["key"]]
        assert outcome.result.text == f"{value}+{sample.meta['addend']}="


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_service_waits_are_in_flight_together_beyond_the_workers(mode):
    task = lookup_task(latency_s=2.0)
    with EnvPool(EnvPoolConfig(mode=mode, workers=WORKERS, tool_concurrency=64)) as pool:
        pool.add_task("lookup", task)
        futures = submit_lookups(pool, "lookup", task, 40)
        check_observations(futures)
        stats = pool.stats()
    most = lookup_service(task).most_waiting
    print(f"\n[io-lane] {mode}: 40 lookups of 2 s, {WORKERS} workers: {most} waited on the service at once")
    assert most > WORKERS and stats["io_in_flight_max"]["lookup"] >= most
    assert stats["calls"] == {"lookup": 40} and stats["stages"]["queue:io"]["count"] == 40
    assert stats["busy_fraction"] == 0.0  # no worker was held by a service wait
    assert lookup_service(task).waiting == 0


def test_tool_concurrency_bounds_calls_in_flight_per_tool():
    first, second = lookup_task(latency_s=1.0, seed=0), lookup_task(latency_s=1.0, seed=1)
    with EnvPool(EnvPoolConfig(mode="thread", workers=WORKERS, tool_concurrency=3)) as pool:
        pool.add_task("first", first)
        pool.add_task("second", second)
        futures = submit_lookups(pool, "first", first, 6) + submit_lookups(pool, "second", second, 6)
        check_observations(futures)
        stats = pool.stats()
    # one bound per tool name, across tasks: two tasks calling the same service share it
    assert stats["io_in_flight_max"] == {"lookup": 3}
    assert lookup_service(first).most_waiting <= 3 and lookup_service(second).most_waiting <= 3
    assert 3 <= lookup_service(first).most_waiting + lookup_service(second).most_waiting <= 6
    assert stats["stages"]["queue:io"]["max"] > 0  # the calls past the bound waited for a slot


def test_cheap_reward_completes_before_tool_waits_submitted_ahead_of_it():
    tool, plain = lookup_task(latency_s=3.0), SyntheticTask(DatasetSpec(kind="addition", eval_size=4))
    finished, lock = [], threading.Lock()

    def note(name):
        def callback(_future):
            with lock:
                finished.append(name)
        return callback

    with EnvPool(EnvPoolConfig(mode="thread", workers=WORKERS)) as pool:
        pool.add_task("lookup", tool)
        pool.add_task("add", plain)
        waits = submit_lookups(pool, "lookup", tool, 20)  # 10x the workers, submitted first
        for future, _ in waits:
            future.add_done_callback(note("lookup"))
        env = environment_for(plain)
        sample = plain.train_sample(0)
        env.reset(sample)
        reward = pool.submit("add", env, sample.answer)
        reward.add_done_callback(note("reward"))
        outcome = reward.result(timeout=120)
        check_observations(waits)
    assert outcome.error is None and not outcome.io and outcome.result.reward == 1.0
    assert finished[0] == "reward" and finished.count("lookup") == 20


def test_step_timeout_applies_to_service_waits_and_the_pool_keeps_serving():
    slow, quick = lookup_task(latency_s=30.0), lookup_task(latency_s=0.0, seed=1)
    with EnvPool(EnvPoolConfig(mode="thread", workers=WORKERS, step_timeout_s=0.5)) as pool:
        pool.add_task("slow", slow)
        pool.add_task("quick", quick)
        [(late, _)] = submit_lookups(pool, "slow", slow, 1)
        outcome = late.result(timeout=60)
        assert outcome.error is not None and outcome.error.cause == "timeout" and outcome.error.task_key == "slow"
        check_observations(submit_lookups(pool, "quick", quick, 4))
        assert pool.stats()["errors"] == {"slow": [str(outcome.error)]}


def test_tool_env_names_the_service_tools_a_turn_waits_on():
    compact, xml = ToolEnv(lookup_task(0.0)), ToolEnv(lookup_task(0.0, syntax="xml"))
    for env in (compact, xml):
        env.reset(env.task.train_sample(0))
    assert compact.service_waits("?") == {"lookup"} and compact.service_waits("42") == frozenset()
    assert xml.service_waits('<tool name="lookup">c4</tool>') == {"lookup"}
    assert xml.service_waits('<tool name="calculator">1+1</tool>') == frozenset()  # unknown here, and not a service
    assert xml.service_waits('<tool name="lookup">c4') == frozenset()  # malformed: answered without a wait
    assert xml.service_waits("<answer>7</answer>") == frozenset()
