"""What the rollout engine tests share (their fixtures, codec / adapters / hf_engine, are in conftest): the requests,
what every engine is checked for, and what a vLLM worker holds."""
from __future__ import annotations

import numpy as np

from marlaas_hpc.rollout import GenerationRequest

PROMPTS = ["12+7=", "reverse: abcd =", "sort: 3 1 2 =", "9", "count a in banana ="]


def mixed_requests(codec, temperature, max_new_tokens=12, tag=""):
    """Every prompt under t1, t2 and the base model, interleaved (prompts of different lengths)."""
    reqs = []
    for i, text in enumerate(PROMPTS):
        for task, version in (("t1", 0), ("t2", 0), ("base", None)):
            reqs.append(GenerationRequest(f"{tag}{task}-{i}-T{temperature}", task, version, codec.encode_prompt(text),
                                          temperature=temperature, max_new_tokens=max_new_tokens, seed=100 + i))
    return reqs


def check_sampled_logprobs_equal_teacher_forcing(engine, codec, adapters, peft_reference) -> None:
    """Sampled (t 0.7) mixed requests: each token's logprob equals PEFT's teacher-forced one at that token."""
    deltas = []
    for gen in engine.generate(mixed_requests(codec, 0.7, max_new_tokens=16)):
        assert len(gen.logprobs) == len(gen.completion_ids) > 0
        path = adapters.get(gen.task_id) if gen.adapter_version is not None else None
        ref = peft_reference.logprobs(path, gen.prompt_ids, gen.completion_ids, 0.7)
        deltas += list(np.abs(np.array(gen.logprobs) - np.array(ref)))
    assert np.mean(deltas) < 1e-4 and np.max(deltas) < 1e-3


def check_mixed_batch_rows_equal_single_runs(engine, codec, temperature) -> None:
    """Each row of one batch of mixed adapters (and the base) samples what the same request sampled alone."""
    batch = engine.generate(mixed_requests(codec, temperature, tag="batch-"))
    for gen, req in zip(batch, mixed_requests(codec, temperature, tag="single-")):
        [single] = engine.generate([req])
        assert (gen.adapter_version, gen.completion_ids) == (single.adapter_version, single.completion_ids)
        np.testing.assert_allclose(gen.logprobs, single.logprobs, atol=1e-4)  # fp32, other shapes


def held_adapter_ids(worker) -> list[int]:
    """Runs in the vLLM worker (`llm.collective_rpc`): the int ids of the in-memory adapters it holds."""
    return sorted(worker.model_runner.lora_manager.marlaas_memory)
