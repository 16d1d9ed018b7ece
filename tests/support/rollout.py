"""What the rollout engine tests share (their fixtures, codec / adapters / hf_engine, are in conftest): the requests,
and what a vLLM worker holds."""
from __future__ import annotations

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


def held_adapter_ids(worker) -> list[int]:
    """Runs in the vLLM worker (`llm.collective_rpc`): the int ids of the in-memory adapters it holds."""
    return sorted(worker.model_runner.lora_manager.marlaas_memory)
