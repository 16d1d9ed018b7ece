"""Issue #29's repack at the engine level: a sequence cut mid-way on one engine (`abort`: its partial tokens,
their logprobs and its pinned version) continues on another engine, which prefills prompt + partial under the
same version, with the tokens and logprobs it would have had whole; and the heavy-tailed `long_tail` kind, whose
prompts set their completions' lengths (sampled through stop tokens: `ignore_stop`)."""
from __future__ import annotations

import dataclasses
import math
import statistics

import numpy as np
import pytest

from marlaas_hpc.rollout import AdapterRef, GenerationRequest, make_engine
from marlaas_hpc.rollout.base import DecodeOccupancy

LENGTH = 24
CUT = 9


def _request(codec, temperature: float) -> GenerationRequest:
    return GenerationRequest("long#0@1", "task", 0, codec.encode_prompt("12+7="), temperature=temperature,
                             max_new_tokens=LENGTH, seed=41, ignore_stop=True)


def _engine(tiny_model_path, adapters, versions, **kwargs):
    engine = make_engine("hf", tiny_model_path, seed=5, **kwargs)
    for version in versions:  # v0 = adapter t1, v1 = adapter t2: two different policies of one task
        engine.add_adapter(AdapterRef("task", version, str(adapters[("t1", "t2")[version]])))
        if version == 0 and len(versions) > 1:
            engine.pin("task", 0)  # the tail rank keeps the pinned version (runtime/retention.py's rule)
    return engine


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_repacked_sequence_continues_with_identical_logprobs(tiny_model_path, adapters, codec, temperature):
    request = _request(codec, temperature)
    [whole] = _engine(tiny_model_path, adapters, [0]).generate([request])
    assert len(whole.completion_ids) == LENGTH

    source = _engine(tiny_model_path, adapters, [0], step_tokens=CUT)
    source.submit([request])
    assert source.step() == [] and source.has_unfinished()  # CUT tokens sampled, the rest to come
    [partial] = source.abort([request.request_id])
    assert not source.has_unfinished() and source.versions.in_flight[("task", 0)] == 0
    assert partial.adapter_version == 0 and partial.partial_ids == whole.completion_ids[:CUT]
    np.testing.assert_allclose(partial.partial_logprobs, whole.logprobs[:CUT], atol=1e-5)

    tail = _engine(tiny_model_path, adapters, [0, 1])  # holds the newer v1 too: the continuation must use v0
    [moved] = tail.generate([partial])
    assert moved.adapter_version == 0 and moved.request_id == request.request_id
    assert moved.completion_ids == whole.completion_ids
    np.testing.assert_allclose(moved.logprobs, whole.logprobs, atol=1e-4)

    # the comparison above can fail: under the newer version, or without the partial tokens, it does not hold
    [newer] = tail.generate([dataclasses.replace(partial, request_id="newer", adapter_version=1)])
    assert not np.allclose(newer.logprobs[CUT:], whole.logprobs[CUT:len(newer.logprobs)], atol=1e-2)
    [dropped] = tail.generate([dataclasses.replace(partial, request_id="dropped", partial_ids=[],
                                                   partial_logprobs=[], max_new_tokens=LENGTH - CUT)])
    assert dropped.completion_ids != whole.completion_ids[CUT:] or \
        not np.allclose(dropped.logprobs, whole.logprobs[CUT:], atol=1e-2)


def test_step_tokens_cut_and_continue_in_one_engine_equals_whole(tiny_model_path, adapters, codec):
    request = _request(codec, 1.0)
    [whole] = _engine(tiny_model_path, adapters, [0]).generate([request])
    stepped = _engine(tiny_model_path, adapters, [0], step_tokens=5)
    [gen] = stepped.generate([request, dataclasses.replace(request, request_id="short", max_new_tokens=3)])[:1]
    assert gen.completion_ids == whole.completion_ids
    np.testing.assert_allclose(gen.logprobs, whole.logprobs, atol=1e-4)
    assert stepped.versions.in_flight[("task", 0)] == 0


def test_continuation_needs_its_version_and_consistent_partial(tiny_model_path, adapters, codec):
    engine = _engine(tiny_model_path, adapters, [0])
    engine.add_adapter(AdapterRef("task", 1, str(adapters["t2"])))  # v0 unpinned and unused: retired
    partial = dataclasses.replace(_request(codec, 0.0), partial_ids=[5, 6], partial_logprobs=[-1.0, -2.0])
    with pytest.raises(KeyError, match="task v0"):
        engine.submit([partial])
    with pytest.raises(ValueError, match="one logprob each"):
        engine.submit([dataclasses.replace(partial, adapter_version=1, partial_logprobs=[-1.0])])
    with pytest.raises(ValueError, match="past its partial"):
        engine.submit([dataclasses.replace(partial, adapter_version=1, max_new_tokens=2)])


def test_ignore_stop_samples_exactly_the_length(tiny_model_path, adapters, codec):
    engine = _engine(tiny_model_path, adapters, [0])
    prompt = codec.encode_prompt("12+7=")
    stops = GenerationRequest("stops", "task", 0, prompt, temperature=0.0, max_new_tokens=40)
    through = dataclasses.replace(stops, request_id="through", ignore_stop=True)
    stopped, full = engine.generate([stops, through])
    assert stopped.finish_reason == "stop" and len(stopped.completion_ids) < 40  # the tiny model answers, then eos
    assert len(full.completion_ids) == 40 and full.finish_reason == "length"
    assert full.completion_ids[:len(stopped.completion_ids)] == stopped.completion_ids
    assert engine.occupancy()["token_steps"] == len(stopped.completion_ids) + 40


def test_decode_occupancy_counts_sparse_steps():
    occupancy = DecodeOccupancy()
    occupancy.add_batch([1, 1, 1, 1, 1, 1, 1, 10])  # 8 rows; after step 1 one row runs for 9 steps
    occupancy.add_batch([2, 3])
    assert occupancy.as_dict() == {"running": {"1": 10, "2": 2, "8": 1}, "decode_steps": 13, "row_steps": 86,
                                   "token_steps": 22}
    assert occupancy.sparse_steps(8) == 10 and occupancy.sparse_steps(16) == 12 and occupancy.sparse_steps(4) == 0


def test_long_tail_kind_lengths_are_heavy_tailed_and_reach_the_prompt_group():
    from marlaas_hpc.env.kinds import build_task_data
    from marlaas_hpc.tasks.spec import DatasetSpec
    from marlaas_hpc.tasks.synthetic import LONG_TAIL_MEDIAN

    data = build_task_data(DatasetSpec(kind="long_tail", eval_size=8))
    lengths = sorted(n for i in range(1000) for n in data.completion_tokens(data.train_sample(i), 4))
    median, p99 = statistics.median(lengths), lengths[int(0.99 * len(lengths))]
    assert abs(median - LONG_TAIL_MEDIAN) <= 1 and 7 <= p99 / median <= 13, (median, p99)
    group = data.completion_tokens(data.train_sample(3), 4)
    assert group == data.completion_tokens(data.train_sample(3), 4) and len(set(group)) > 1  # seeded, per sample
    other_seed = build_task_data(DatasetSpec(kind="long_tail", eval_size=8, seed=1))
    assert [other_seed.completion_tokens(other_seed.train_sample(i), 4) for i in range(5)] != \
        [data.completion_tokens(data.train_sample(i), 4) for i in range(5)]
    sample = data.train_sample(0)
    assert data.score(sample, sample.answer) == 1.0 and not math.isnan(data.score(sample, "x"))
    plain = build_task_data(DatasetSpec(kind="addition", eval_size=8))
    assert plain.completion_tokens(plain.train_sample(0), 4) is None


def test_repacker_hands_over_only_a_few_sequences_all_past_their_quantile():
    from marlaas_hpc.config import RepackSettings
    from marlaas_hpc.runtime.repack import Repacker

    repacker = Repacker(RepackSettings(enabled=True, min_lengths=10), slots=16, tails=(7, 8))
    for n in range(1, 11):
        repacker.record("t", n)  # lengths 1..10: the 0.9 quantile is 10
    assert repacker.quantile("t") == 10 and repacker.quantile("other") is None
    assert repacker.held_by_tail({"r1": ("t", 11), "r2": ("t", 12)})
    assert not repacker.held_by_tail({"r1": ("t", 11), "r2": ("t", 10)}), "one sequence not past the quantile"
    assert not repacker.held_by_tail({f"r{i}": ("t", 20) for i in range(4)}), "a quarter of 16 slots is busy"
    assert not repacker.held_by_tail({"r1": ("other", 99)}), "a task with too few lengths seen"
    assert not repacker.held_by_tail({})
    assert [repacker.next_tail() for _ in range(3)] == [7, 8, 7] and repacker.handed == 3


def test_tail_versions_keep_the_newest_versions_pinned(tiny_model_path, adapters):
    from marlaas_hpc.runtime.repack import TailVersions

    engine = make_engine("hf", tiny_model_path)
    tail = TailVersions(keep=2)
    for version in range(4):
        engine.add_adapter(AdapterRef("task", version, str(adapters[("t1", "t2")[version % 2]])))
        tail.installed(engine, "task", version)
    assert engine.versions.live("task") == [2, 3]  # without the pins only v3 would be live
    assert tail.holds(engine, "task", 2) and not tail.holds(engine, "task", 1)


@pytest.mark.parametrize("change, message", [
    ({"engine": "vllm"}, "engine: hf"), ({"delta": {"transport": "relay"}}, "broadcast"),
    ({"fault": {"on_rank_loss": "continue"}}, "on_rank_loss: stop"), ({"layout": {"rollout_ranks": 1}}, "leaves no"),
    ({"repack": {"enabled": True, "busy_below": 1.5}}, "busy_below")])
def test_repack_settings_refused_where_not_wired(change, message):
    from marlaas_hpc.config import JobConfig
    from marlaas_hpc.config_loader import SpecError, load_config

    base = {"engine": "hf", "layout": {"rollout_ranks": 2}, "fault": {"on_rank_loss": "stop"},
            "repack": {"enabled": True}}
    with pytest.raises(SpecError, match=message):
        load_config(JobConfig, {**base, **change}).validate()
    job = load_config(JobConfig, base).validate()
    assert job.scheduler_config([3, 4], [1]).rollout_ranks == (3,) and job.repack.tails([3, 4]) == (4,)
    assert load_config(JobConfig, {}).validate().scheduler_config([3, 4], [1]).rollout_ranks == (3, 4)
