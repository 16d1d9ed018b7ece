"""A rollout rank's in-memory adapter versions on vLLM (rollout/vllm_engine.py): vLLM reloads an adapter whenever it
is not in its LoRA cache (LRU eviction) and a request names it. With one cache slot, an episode's pinned old
version is evicted by each newer one; its next turn makes vLLM build it again from the tensors the worker holds,
with the same logprobs (vLLM scales a loaded adapter's lora_b in place: a reload from a shared tensor would scale
it twice), and the worker lets go of them only once the engine retired the version."""
from __future__ import annotations

import numpy as np
import pytest

from marlaas_hpc.rollout import AdapterRef, GenerationRequest, make_engine
from marlaas_hpc.rollout.restart import RestartingEngine
from marlaas_hpc.trainer.peft_io import read_peft_adapter
from support.rollout import PROMPTS, held_adapter_ids

pytestmark = pytest.mark.vllm


def test_a_pinned_version_evicted_from_vllm_reloads_from_memory_until_retired(tiny_model_path, adapters, codec):
    pytest.importorskip("vllm")
    from marlaas_hpc.model.cache import default_cache_dir

    engine = RestartingEngine(lambda: make_engine(
        "vllm", tiny_model_path, work_dir=default_cache_dir() / "vllm-test-engine", max_loras=1, max_cpu_loras=1,
        max_lora_rank=8, seed=0))
    weights = {name: read_peft_adapter(path) for name, path in adapters.items()}
    int_ids = {}

    def land(version, name):
        lora, tensors = weights[name]
        engine.add_adapter(AdapterRef("t", version, tensors=tensors, lora=lora))
        int_ids[version] = engine.versions.int_id[("t", version)]
        return [(ref.task_id, ref.version) for ref in engine.pop_retired()]

    def held():
        [ids] = engine.engine.llm.collective_rpc(held_adapter_ids)
        return sorted(v for v, i in int_ids.items() if i in ids)

    def turn(tag, version):
        [gen] = engine.generate([GenerationRequest(f"{tag}", "t", version, codec.encode_prompt(PROMPTS[2]),
                                                   temperature=0.0, max_new_tokens=10)])
        return gen.completion_ids, gen.logprobs

    try:
        assert land(0, "t1") == []
        first = turn("turn1", 0)
        engine.pin("t", 0)  # the episode waits on its tool
        assert land(1, "t2") == [] and land(2, "t2") == [("t", 1)], "v1: superseded and unused"
        assert ("t", 0) not in engine.engine.loaded_adapters(), "evicted from vLLM's one-slot LoRA cache"
        assert held() == [0, 2], "v0 pinned: the worker keeps its tensors; v1 retired: let go"
        again, other = turn("turn2", 0), turn("other", 2)
        assert again[0] == first[0], "the next turn rebuilt v0 from memory"
        np.testing.assert_allclose(again[1], first[1], atol=1e-6)
        differs = other[0] != first[0] or not np.allclose(other[1], first[1], atol=1e-3)
        assert differs, "v2 samples differently (the check above means something)"
        engine.unpin("t", 0)
        assert [(r.task_id, r.version) for r in engine.pop_retired()] == [("t", 0)]
        assert held() == [2]
    finally:
        engine.close()
