"""Env pool: faulty reward functions fail their own task only; per-call timeouts in thread and process mode;
a crashed worker is replaced; per-stage timings are recorded."""
import functools
import math
import os
import time

import pytest

from marlaas_hpc.env import (EnvError, EnvPool, EnvPoolConfig, EpisodeRequest, EpisodeRunner, LookupTask,
                             SingleTurnEnv, environment_for, summarize_episodes)
from marlaas_hpc.tasks import DatasetSpec, RewardError, Sample
from marlaas_hpc.tasks.synthetic import SyntheticTask
from support.scripted_engine import ScriptedEngine



@functools.cache
def codec():
    """Built lazily: process workers import this module to unpickle FaultyTask, and the tokenizer needs
    transformers (seconds to import), which env workers should not pay for."""
    from marlaas_hpc.model.codec import TextCodec
    from marlaas_hpc.model.tokenizer import build_char_tokenizer

    return TextCodec(build_char_tokenizer())


class FaultyTask(SyntheticTask):
    """Addition whose reward function misbehaves in a chosen way (module level: process workers import it)."""

    def __init__(self, fault: str):
        super().__init__(DatasetSpec(kind="addition", eval_size=4))
        self.fault = fault

    def score(self, sample, completion):
        if self.fault == "raise":
            raise KeyError("reward lookup failed")
        if self.fault == "hang":
            time.sleep(float(completion) if completion.replace(".", "").isdigit() else 60)
            return 1.0
        if self.fault == "crash":
            os._exit(7)
        return {"nan": math.nan, "big": 1.5, "negative": -0.5, "ok": super().score(sample, completion)}[self.fault]


def env_for(task, i=0):
    env = SingleTurnEnv(task)
    env.reset(task.train_sample(i))
    return env


@pytest.mark.parametrize("fault, says", [("raise", "raised KeyError"), ("nan", "nan"), ("big", "1.5"),
                                         ("negative", "-0.5")])
def test_faulty_reward_fails_its_own_task_only(fault, says):
    good, bad = SyntheticTask(DatasetSpec(kind="addition", eval_size=4)), FaultyTask(fault)
    engine = ScriptedEngine(codec(), lambda r, c: "7")
    requests = [EpisodeRequest(task_id, "g", task.train_sample(i), environment_for(task))
                for i in range(4) for task_id, task in (("good", good), ("bad", bad))]
    with EnvPool(EnvPoolConfig(mode="thread", workers=2)) as pool:
        results = EpisodeRunner(engine, codec(), pool).run(requests)
        stats = pool.stats()
    for result in results:
        if result.request.task_id == "bad":
            assert result.finish == "error" and result.trajectory is None
            assert isinstance(result.error, RewardError) and result.error.task_key == "bad"
            assert result.error.cause == "reward" and says in str(result.error)
        else:
            assert result.finish == "answer" and result.error is None and result.trajectory is not None
    assert len(stats["errors"]["bad"]) == 4 and "good" not in stats["errors"]


def test_thread_mode_timeout_replaces_the_stuck_worker():
    task = FaultyTask("hang")
    with EnvPool(EnvPoolConfig(mode="thread", workers=1, step_timeout_s=0.3)) as pool:
        pool.add_task("hang", task)
        start = time.monotonic()
        stuck = pool.step("hang", env_for(task), "3")  # sleeps 3 s; reported after ~0.3 s
        assert stuck.error is not None and stuck.error.cause == "timeout" and time.monotonic() - start < 2.0
        quick = pool.step("hang", env_for(task), "0.01")  # the replacement thread serves at once
        assert quick.error is None and quick.result.reward == 1.0 and time.monotonic() - start < 2.5
        assert pool.stats()["errors"]["hang"] == [str(stuck.error)]


def test_process_mode_kills_hung_and_crashed_workers_and_keeps_serving():
    hang, crash, ok = FaultyTask("hang"), FaultyTask("crash"), FaultyTask("ok")
    with EnvPool(EnvPoolConfig(mode="process", workers=2, step_timeout_s=1.0)) as pool:
        for key, task in (("hang", hang), ("crash", crash), ("ok", ok)):
            pool.add_task(key, task)
        futures = [pool.submit("hang", env_for(hang), "60"), pool.submit("crash", env_for(crash), "1")]
        hung, crashed = [f.result(timeout=30) for f in futures]
        assert hung.error.cause == "timeout" and hung.error.task_key == "hang"
        assert crashed.error.cause == "crash" and "exit code 7" in str(crashed.error)
        sample = ok.train_sample(0)
        env = env_for(ok)
        served = pool.step("ok", env, sample.answer)
        assert served.error is None and served.result.reward == 1.0
        assert served.env is not env and served.env.task is ok and served.env.sample == sample
        stats = pool.stats()
        assert stats["calls"] == {"hang": 1, "crash": 1, "ok": 1} and stats["stages"]["reward"]["count"] == 1


def test_process_mode_runs_multi_turn_episodes_like_thread_mode():
    task = LookupTask(DatasetSpec(kind="lookup", eval_size=8))

    def policy(request, context):
        if "<eos>" not in context:
            return "?"
        a, b = context.rsplit("<eos>", 1)[1].rstrip("=").split("+")
        return str(int(a) + int(b))

    outcomes = {}
    for mode in ("thread", "process"):
        with EnvPool(EnvPoolConfig(mode=mode, workers=2)) as pool:
            runner = EpisodeRunner(ScriptedEngine(codec(), policy), codec(), pool)
            results = runner.run([EpisodeRequest("lookup", "g", s, environment_for(task))
                                  for s in task.eval_samples()])
            outcomes[mode] = [(r.reward, r.transcript, r.trajectory.completion_ids) for r in results]
            stats = pool.stats()
        assert summarize_episodes(results)["mean_reward"] == 1.0
        assert {"queue", "step", "reward", "tool:lookup", "task:lookup"} <= set(stats["stages"])
        assert stats["stages"]["tool:lookup"]["count"] == 8 and 0 <= stats["busy_fraction"] <= 1
    assert outcomes["thread"] == outcomes["process"]


def test_pool_refuses_unknown_tasks_and_unpicklable_tasks_in_process_mode():
    task = FaultyTask("ok")
    with EnvPool(EnvPoolConfig(mode="inline")) as pool:
        with pytest.raises(KeyError):
            pool.submit("missing", env_for(task), "1")
    with EnvPool(EnvPoolConfig(mode="process", workers=1)) as pool:
        task.score = lambda sample, completion: 1.0  # a lambda cannot travel to a worker process
        with pytest.raises(ValueError, match="cannot be sent"):
            pool.add_task("lambda", task)
    with pytest.raises(ValueError):
        EnvPoolConfig(mode="fibers").validate()
    assert isinstance(EnvError("t", "reward", "x"), RewardError)
    assert Sample(0, "p", "a") == Sample(0, "p", "a")


@pytest.mark.parametrize("change, field", [
    ({"env_pool": {"mode": "fibers"}}, "env_pool.mode"),
    ({"env_pool": {"workers": 0}}, "env_pool.workers"),
    ({"env_pool": {"threads": 2}}, "env_pool.threads"),
    ({"env_pool": {"tool_concurrency": 0}}, "env_pool.tool_concurrency"),
    ({"env_pool": {"tool_concurrency": "many"}}, "env_pool.tool_concurrency"),
    ({"tasks": [{"task_id": "t", "dataset": {"kind": "lookup"}, "algo": {"max_turns": 0}}]}, "tasks[0].algo.max_turns"),
    ({"tasks": [{"task_id": "t", "dataset": {"kind": "lookup", "tool_latency_s": -1}}]},
     "tasks[0].dataset.tool_latency_s"),
])
def test_job_config_refuses_bad_env_settings_naming_the_field(change, field):
    from marlaas_hpc.config import JobConfig
    from marlaas_hpc.tasks import SpecError

    with pytest.raises(SpecError) as refused:
        JobConfig.from_dict(change)
    assert refused.value.field == field
    assert JobConfig.from_dict({"env_pool": {"mode": "process", "workers": 3}}).env_pool.workers == 3
    assert JobConfig.from_dict({"env_pool": {"tool_concurrency": 512}}).env_pool.tool_concurrency == 512


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_a_cancelled_task_s_queued_steps_never_run_and_others_do_not_wait_behind_them(mode):
    """A failed task's steps still queued finish at once with a 'cancelled' error, none of them run (a crashing
    reward's calls each started a fresh worker that the other tasks' steps waited behind); the others run."""
    slow, crash, good = FaultyTask("hang"), FaultyTask("crash"), SyntheticTask(DatasetSpec(kind="addition"))
    with EnvPool(EnvPoolConfig(mode=mode, workers=1, step_timeout_s=30)) as pool:
        for key, task in (("slow", slow), ("crash", crash), ("good", good)):
            pool.add_task(key, task)
        first = pool.submit("slow", env_for(slow), "1.5")  # holds the only worker for 1.5 s
        doomed = [pool.submit("crash", env_for(crash, i), "7") for i in range(3)]
        kept = pool.submit("good", env_for(good), "7")
        pool.cancel_task("crash")
        outcomes = [future.result(timeout=20) for future in doomed]
        assert all(o.error is not None and o.error.cause == "cancelled" for o in outcomes)
        assert kept.result(timeout=20).error is None and first.result(timeout=20).error is None
        assert "crash" not in pool.stats()["calls"]  # none of them ran
