"""A rollout rank's adapter copies on vLLM (runtime/retention.py ScratchAdapters): vLLM reloads an adapter from
its path whenever it is not in its LoRA cache (LRU eviction) and a request names it. With one cache slot, an
episode's pinned old version is evicted by each newer one; its next turn makes vLLM read the copy from disk
again, so the copy must still be there, and it goes only once the engine retired the version."""
from __future__ import annotations

import numpy as np
import pytest

from marlaas_hpc.rollout import AdapterRef, GenerationRequest, make_engine
from marlaas_hpc.rollout.restart import RestartingEngine
from marlaas_hpc.runtime.retention import ScratchAdapters, version_dirs
from marlaas_hpc.trainer.peft_io import read_peft_adapter
from rollout_helpers import PROMPTS

pytestmark = pytest.mark.vllm


def test_a_pinned_version_evicted_from_vllm_reloads_from_its_copy_until_retired(tmp_path, tiny_model_path,
                                                                                  adapters, codec):
    pytest.importorskip("vllm")
    from marlaas_hpc.model.tiny import default_cache_dir

    engine = RestartingEngine(lambda: make_engine(
        "vllm", tiny_model_path, work_dir=default_cache_dir() / "vllm-test-engine", max_loras=1, max_cpu_loras=1,
        max_lora_rank=8, seed=0))
    scratch = ScratchAdapters(tmp_path / "adapters")
    weights = {name: read_peft_adapter(path) for name, path in adapters.items()}

    def land(version, name):
        lora, tensors = weights[name]
        engine.add_adapter(AdapterRef("t", version, str(scratch.write("t", version, tensors, lora))))
        return scratch.drop_retired(engine)

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
        assert sorted(version_dirs(tmp_path / "adapters" / "t")) == [0, 2], "v0 pinned: its copy stays"
        again, other = turn("turn2", 0), turn("other", 2)
        assert again[0] == first[0], "the next turn reloaded v0 from its copy"
        np.testing.assert_allclose(again[1], first[1], atol=1e-5)
        assert not np.allclose(other[1], first[1], atol=1e-3), "v2 differs (the check above means something)"
        engine.unpin("t", 0)
        assert scratch.drop_retired(engine) == [("t", 0)]
        assert sorted(version_dirs(tmp_path / "adapters" / "t")) == [2]
    finally:
        engine.close()
