"""The learning core end to end, in one process: trainer <-> rollout engines agree, and GRPO really learns.

- At equal adapter version the trainer's logprobs of sampled tokens equal the engine's behaviour logprobs
  (fp32, mean |delta| < 1e-4) for a freshly trained, non-zero adapter: catches a rollout that silently used
  the base model or the wrong adapter.
- On one synthetic task, greedy eval accuracy after N GRPO steps beats the base model's by >= 20 points.
"""
import pytest
import torch

from marlaas_hpc.rundir import adapter_dir
from marlaas_hpc.model import TextCodec
from marlaas_hpc.rollout import AdapterRef, GenerationRequest, make_engine
from marlaas_hpc.tasks import TaskSpec
from marlaas_hpc.trainer.trainer import MultiLoraTrainer, TrainerConfig
from marlaas_hpc.trajectory import Trajectory
from support.local_driver import LocalDriver

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def trainer(tiny_model_path):
    return MultiLoraTrainer(TrainerConfig(model_path=str(tiny_model_path), seed=0))


def _spec(task_id, kind, **algo):
    base = {"group_size": 8, "batch_prompts": 8, "lr": 3e-3, "temperature": 1.0, "max_new_tokens": 8}
    base.update(algo)
    return TaskSpec.from_dict({"task_id": task_id, "tenant": "test", "dataset": {"kind": kind, "eval_size": 128},
                               "lora": {"rank": 8, "alpha": 16}, "algo": base, "total_steps": 100})


def _trained_adapter(trainer, codec, engine, run_dir, task_id, kind, steps=3):
    """A real non-zero adapter: a few GRPO steps driven by the given engine."""
    driver = LocalDriver(engine, trainer, codec, run_dir, seed=1, log=lambda *_: None)
    driver.add_task(_spec(task_id, kind))
    for _ in range(steps):
        driver.train(task_id, driver.rollout(task_id))
    b_norm = sum(t.norm().item() for n, t in trainer.adapter_tensors(task_id).items() if "lora_B" in n)
    assert b_norm > 0, "the adapter must be non-zero for the oracle to mean anything"
    return driver


def _oracle_delta(trainer, codec, engine, task_id, version, temperature=0.7):
    prompts = ["12+7=", "rev abcd=", "cnt a:abca=", "srt 5312=", "45+8="]
    requests = [GenerationRequest(f"oracle-{task_id}-{i}", task_id, version, codec.encode_prompt(p), temperature,
                                  8, seed=100 + i) for i, p in enumerate(prompts * 4)]
    gens = engine.generate(requests)
    trajs = [Trajectory(task_id, g.request_id, g.prompt_ids, g.completion_ids, g.logprobs, version) for g in gens]
    trainer_logp = trainer.logprobs(task_id, trajs, temperature)
    deltas = [abs(a - b) for g, lp in zip(gens, trainer_logp) for a, b in zip(g.logprobs, lp)]
    assert len(deltas) == sum(len(g.completion_ids) for g in gens) > 20
    # the same tokens under the base model differ clearly: the check can fail
    base_logp = trainer.logprobs(None, trajs, temperature)
    base_delta = [abs(a - b) for g, lp in zip(gens, base_logp) for a, b in zip(g.logprobs, lp)]
    return sum(deltas) / len(deltas), sum(base_delta) / len(base_delta)


def test_hf_engine_logprobs_match_trainer(trainer, tiny_model_path, tmp_path):
    codec = TextCodec.from_pretrained(tiny_model_path)
    engine = make_engine("hf", tiny_model_path, seed=0)
    driver = _trained_adapter(trainer, codec, engine, tmp_path, "oracle_hf", "count")
    version = trainer.version("oracle_hf")
    mean_delta, base_delta = _oracle_delta(trainer, codec, engine, "oracle_hf", version)
    print(f"HF engine vs trainer at v{version}: mean |dlogp| {mean_delta:.2e} (base model: {base_delta:.2e})")
    assert mean_delta < 1e-4
    assert base_delta > 10 * mean_delta + 1e-3


@pytest.mark.vllm
def test_vllm_engine_logprobs_match_trainer_and_generates_from_export(trainer, tiny_model_path, tmp_path):
    codec = TextCodec.from_pretrained(tiny_model_path)
    engine = make_engine("vllm", tiny_model_path, work_dir=tmp_path / "vllm", seed=0, max_loras=4, max_lora_rank=8)
    try:
        driver = _trained_adapter(trainer, codec, engine, tmp_path, "oracle_vllm", "sort")
        version = trainer.version("oracle_vllm")
        assert (adapter_dir(tmp_path, driver.tasks["oracle_vllm"].spec, version) / "adapter_config.json").is_file()
        mean_delta, base_delta = _oracle_delta(trainer, codec, engine, "oracle_vllm", version)
        print(f"vLLM engine vs trainer at v{version}: mean |dlogp| {mean_delta:.2e} (base model: {base_delta:.2e})")
        assert mean_delta < 1e-4
        assert base_delta > 10 * mean_delta + 1e-3
    finally:
        engine.close()


@pytest.mark.vllm
def test_grpo_learning_beats_base_by_20_points(trainer, tiny_model_path, tmp_path, capsys):
    """Sorting: the base model often leaves the last digit unsorted; GRPO must teach the full sort from reward alone.
    (Reversal, the earlier choice, learns too slowly on some CPUs: the tiny model's pre-training differs by BLAS
    kernel, and on an AVX2-only host its reversal base was 0.59 and reached only 0.66-0.73 after 40-80 steps.)"""
    codec = TextCodec.from_pretrained(tiny_model_path)
    engine = make_engine("vllm", tiny_model_path, work_dir=tmp_path / "vllm", seed=0, max_loras=4, max_lora_rank=8)
    try:
        driver = LocalDriver(engine, trainer, codec, tmp_path, seed=0, log=lambda *_: None)
        spec = _spec("learn_sort", "sort", batch_prompts=16, lr=2e-3, normalize_adv_std=True)
        driver.add_task(spec)
        base = driver.evaluate("learn_sort", use_adapter=False)
        steps, trained = 0, base
        while steps < 40 and trained < base + 0.25:
            for _ in range(10):
                driver.train("learn_sort", driver.rollout("learn_sort"))
            steps += 10
            trained = driver.evaluate("learn_sort")
        with capsys.disabled():
            print(f"\n[learning] sort: base greedy accuracy {base:.3f} -> {trained:.3f} after {steps} GRPO steps")
        assert trained >= base + 0.20
    finally:
        engine.close()
