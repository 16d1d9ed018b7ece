"""vLLM multi-LoRA on CUDA: the GPU engine's behaviour logprobs agree with the trainer on CUDA (the design's
oracle: KL < 1e-3 in fp32), for several adapters mixed in one batch plus the base model.

Collected everywhere, skipped without CUDA (marker `gpu`; `vllm`: its own pytest process, see tools/test.sh).
The engine takes its settings from the job config's `vllm:` section (VllmSettings), as a rollout rank does.
"""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.vllm, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

KL_LIMIT = 1e-3


def _spec(task_id, kind):
    from marlaas_hpc.tasks import TaskSpec

    return TaskSpec.from_dict({"task_id": task_id, "tenant": "gpu", "dataset": {"kind": kind, "eval_size": 32},
                               "lora": {"rank": 8, "alpha": 16},
                               "algo": {"group_size": 8, "batch_prompts": 8, "lr": 3e-3, "max_new_tokens": 8},
                               "total_steps": 100})


@pytest.fixture(scope="module")
def gpu_pair(tiny_model_path, tmp_path_factory):
    """The trainer and a vLLM engine on the one GPU (fp32), with two tasks trained a few steps through it."""
    from support.local_driver import LocalDriver
    from marlaas_hpc.model import TextCodec
    from marlaas_hpc.rollout import make_engine
    from marlaas_hpc.rollout.vllm_settings import VllmSettings
    from marlaas_hpc.trainer.trainer import MultiLoraTrainer, TrainerConfig

    trainer = MultiLoraTrainer(TrainerConfig(model_path=str(tiny_model_path), seed=0, device="cuda"))
    free_before, total = torch.cuda.mem_get_info()
    settings = VllmSettings(gpu_memory_utilization=0.3).validate()  # leaves the trainer room on the same GPU
    work = tmp_path_factory.mktemp("gpu_vllm")
    engine = make_engine("vllm", tiny_model_path, work_dir=work / "engine", seed=0,
                         **settings.engine_kwargs(max_adapters=4, max_lora_rank=8, max_staleness=1))
    codec = TextCodec.from_pretrained(tiny_model_path)
    driver = LocalDriver(engine, trainer, codec, work, seed=1, log=lambda *_: None)
    for task_id, kind in (("gpu_sort", "sort"), ("gpu_count", "count")):
        driver.add_task(_spec(task_id, kind))
        for _ in range(3):
            driver.train(task_id, driver.rollout(task_id))
    yield trainer, engine, codec, (free_before - torch.cuda.mem_get_info()[0]) / total
    engine.close()


def _mixed_batch(trainer, codec):
    from marlaas_hpc.rollout import GenerationRequest

    prompts = ["12+7=", "rev abcd=", "cnt a:abca=", "srt 5312=", "45+8=", "srt 907=", "cnt b:bbab="]
    tasks = [("gpu_sort", trainer.version("gpu_sort")), ("gpu_count", trainer.version("gpu_count")), (None, None)]
    return [GenerationRequest(f"gpu-{i}-{j}", task or "base", version, codec.encode_prompt(prompt), 0.7, 8,
                              seed=100 + 7 * i + j)
            for i, prompt in enumerate(prompts * 3) for j, (task, version) in enumerate(tasks)]


def test_gpu_vllm_multi_lora_logprobs_match_the_trainer(gpu_pair):
    from marlaas_hpc.trajectory import Trajectory

    trainer, engine, codec, engine_share = gpu_pair
    assert trainer.device.type == "cuda"
    assert engine_share > 0.1, f"the engine took {engine_share:.0%} of the GPU: is it on the CPU?"
    requests = _mixed_batch(trainer, codec)
    gens = engine.generate(requests)
    for task_id in ("gpu_sort", "gpu_count", "base"):
        rows = [g for g in gens if g.task_id == task_id]
        adapter = None if task_id == "base" else task_id
        version = None if task_id == "base" else trainer.version(task_id)
        trajs = [Trajectory(adapter or "base", g.request_id, g.prompt_ids, g.completion_ids, g.logprobs, version)
                 for g in rows]
        behaviour = torch.tensor([lp for g in rows for lp in g.logprobs], dtype=torch.float64)
        trained = torch.tensor([lp for row in trainer.logprobs(adapter, trajs, 0.7) for lp in row],
                               dtype=torch.float64)
        assert behaviour.numel() > 40
        log_ratio = trained - behaviour  # tokens sampled from the engine: k3 estimate of KL(engine || trainer)
        kl = (log_ratio.exp() - 1 - log_ratio).mean().item()
        print(f"{task_id}: KL {kl:.2e}, mean |dlogp| {log_ratio.abs().mean().item():.2e} over {behaviour.numel()}")
        assert kl < KL_LIMIT, task_id
        if adapter is not None:  # the same tokens under the base model disagree clearly: the check can fail
            base = torch.tensor([lp for row in trainer.logprobs(None, trajs, 0.7) for lp in row], dtype=torch.float64)
            assert (base - behaviour).abs().mean() > 10 * log_ratio.abs().mean() + 1e-3, task_id


def test_gpu_engines_of_two_models_sleep_apart_each_in_a_process_of_its_own(tiny_model_path, tmp_path):
    """What a GPU rollout rank of several models runs (vllm.engine_process 'auto'): two vLLM engines, each core in
    a process of its own with sleep mode (cumem allocator), in an EngineSet. A sleeping engine gives its KV cache
    and weights back to the GPU, and each model's greedy logprobs are the same after switches as before."""
    import shutil

    import numpy as np
    from safetensors.torch import load_file, save_file

    from marlaas_hpc.model import TextCodec
    from marlaas_hpc.rollout import GenerationRequest, make_engine
    from marlaas_hpc.rollout.engine_set import SLEEP_MODE_KWARGS, EngineSet
    from marlaas_hpc.rollout.vllm_settings import VllmSettings

    other = tmp_path / "other"  # the tiny model with every matrix perturbed: another model of the same shape
    shutil.copytree(tiny_model_path, other)
    generator = torch.Generator().manual_seed(7)
    weights = load_file(str(other / "model.safetensors"))
    save_file({n: w + 0.3 * w.std() * torch.randn(w.shape, generator=generator) if w.dim() == 2 else w
               for n, w in weights.items()}, str(other / "model.safetensors"), metadata={"format": "pt"})
    settings = VllmSettings(gpu_memory_utilization=0.3).validate()
    kwargs = {**settings.engine_kwargs(max_adapters=2, max_lora_rank=8, max_staleness=1), **SLEEP_MODE_KWARGS,
              "own_process": settings.own_process(2, on_gpu=True)}
    engines = EngineSet({name: (lambda path=path, name=name: make_engine("vllm", path, work_dir=tmp_path / name,
                                                                          seed=0, **kwargs))
                         for name, path in (("tiny", tiny_model_path), ("other", other))})
    codec = TextCodec.from_pretrained(tiny_model_path)
    prompts = ["12+7=", "rev abcd=", "srt 5312="]

    def greedy(model, tag):
        if engines.awake != model:
            engines.switch(model)
        return engines.engine(model).generate([GenerationRequest(f"{tag}-{i}", "base", None, codec.encode_prompt(p),
                                                                 0.0, 8) for i, p in enumerate(prompts)])
    try:
        first = {model: greedy(model, f"first-{model}") for model in ("tiny", "other")}
        awake_free = torch.cuda.mem_get_info()[0]
        engines.sleep("other")
        asleep_free, total = torch.cuda.mem_get_info()
        assert asleep_free - awake_free > 0.2 * total, "a sleeping engine gives its share of the GPU back"
        for model in ("tiny", "other", "tiny", "other"):
            for again, ref in zip(greedy(model, f"again-{model}-{len(engines.switches)}"), first[model]):
                assert again.completion_ids == ref.completion_ids
                np.testing.assert_allclose(again.logprobs, ref.logprobs, atol=1e-5)
        assert any(a.completion_ids != b.completion_ids or abs(a.logprobs[0] - b.logprobs[0]) > 1e-3
                   for a, b in zip(first["tiny"], first["other"])), "two models, two outputs"
        print(f"switches (sleep + wake, s): {[round(s.total_s, 3) for s in engines.switches]}")
    finally:
        engines.close()
