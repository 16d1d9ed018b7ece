"""The megatron-core multi-LoRA trainer on CPU: TP=2 equals TP=1, equals transformers(+PEFT), tasks are isolated.

Every check runs on the tiny char model and on random-weight checkpoints with the real traits of each served
family (model/random_checkpoints.py), tied and untied: Qwen3 (151,936-row vocabulary, GQA, qk-norm, head_dim
64), Qwen2.5 (the same vocabulary, q/k/v biases, no qk-norm) and Llama 3.x (128,256 rows, llama3 RoPE scaling,
rope_theta 500,000). Megatron pads Qwen's vocabulary to 152,064 rows at TP=2 (Llama's 128,256 rows to 128,512
at TP=4), so the padded logits must stay out of every softmax. One scenario per TP size and checkpoint
(tests/support/trainer_scenarios.py) runs in spawned gloo processes -- TP=1 and TP=2 concurrently, each process
running every checkpoint's scenario in turn -- and every test checks part of their records against each other or
against HF/PEFT. TP=2 also runs with a micro-batch token budget (TP=1: the whole batch at once), so it checks
gradient accumulation too.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from support.checks import max_diff
from support.local_group import checkpoint_records, run_at_tp1_and_tp2
from support.trainer_scenarios import (FUSED_STEPS, TASKS, base_logits_per_checkpoint, make_trajectories, probe_ids,
                                       scenario_per_checkpoint)

TOL = 1e-5
LOGIT_TOL = 1e-4
"""Megatron vs transformers forward (fp32): the real checkpoints' 151,936-way logits sum longer dot products."""
MICRO_BATCH_TOKENS = 40
"""TP=2's micro-batch budget: the 24 trajectories (5-16 tokens each) split into several passes."""
pytestmark = pytest.mark.slow  # ~25 s of megatron imports per process before anything runs
CHECKPOINTS = ["tiny", "random:qwen3-0.6b-mini", "random:qwen3-8b-mini", "random:qwen2.5-0.5b-mini",
               "random:qwen2.5-7b-mini", "random:llama3.2-1b-mini", "random:llama3.1-8b-mini"]


def _hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def _behaviour_batches(hf_base) -> dict:
    """Per task: trajectories with behaviour logprobs = HF base logprobs at the task's temperature + noise
    (ratios near 1: some tokens clipped, most not) and group-relative advantages."""
    from marlaas_hpc.trainer.objectives import token_logprobs
    from marlaas_hpc.trajectory import assign_advantages

    noise = random.Random(0)
    out = {}
    for index, (task_id, (_, algo)) in enumerate(TASKS.items()):
        trajs = make_trajectories(task_id, seed=100 + index, vocab=hf_base.config.vocab_size)
        for traj in trajs:
            ids = torch.tensor([traj.prompt_ids + traj.completion_ids])
            with torch.no_grad():
                logits = hf_base(input_ids=ids).logits[0, len(traj.prompt_ids) - 1:-1]
            logp = token_logprobs(logits, torch.tensor(traj.completion_ids), algo.temperature)
            traj.behaviour_logprobs = [v + noise.gauss(0.0, 0.1) if m else 0.0
                                       for v, m in zip(logp.tolist(), traj.mask())]
        assign_advantages(trajs)
        out[task_id] = trajs
    return out


@pytest.fixture(scope="module")
def scenario_inputs(tiny_model_path) -> dict[str, tuple]:
    """Per checkpoint: (path, probe rows, batches), each from its HF base model (loaded here, then let go)."""
    from marlaas_hpc.model.random_checkpoints import ensure_random_checkpoint

    out = {}
    for checkpoint in CHECKPOINTS:
        path = tiny_model_path if checkpoint == "tiny" else ensure_random_checkpoint(checkpoint.split(":", 1)[1])
        hf_base = _hf_model(path)
        out[checkpoint] = (path, probe_ids(hf_base.config.vocab_size), _behaviour_batches(hf_base))
    return out


@pytest.fixture(scope="module")
def all_runs(scenario_inputs, tmp_path_factory) -> dict[str, dict[int, list[dict]]]:
    """{checkpoint: {tp: [record of rank 0, ...]}} for TP=1 (whole batch) and TP=2 (micro-batches by token
    budget): ONE process for TP=1 and one pair for TP=2, run concurrently, each running every checkpoint's
    scenario in turn (one megatron import per process, not one per checkpoint)."""
    out_dir = tmp_path_factory.mktemp("trainer_exports")
    runs = {tp: {checkpoint: (str(path), tp, batches, str(out_dir / checkpoint.replace(":", "_")),
                              0 if tp == 1 else MICRO_BATCH_TOKENS, probe)
                 for checkpoint, (path, probe, batches) in scenario_inputs.items()} for tp in (1, 2)}
    return run_at_tp1_and_tp2(scenario_per_checkpoint, runs, timeout=300 * len(CHECKPOINTS))


@pytest.fixture(scope="module", params=CHECKPOINTS)
def checkpoint(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def model_path(checkpoint, scenario_inputs):
    return scenario_inputs[checkpoint][0]


@pytest.fixture(scope="module")
def hf_base(model_path):
    return _hf_model(model_path)


@pytest.fixture(scope="module")
def probe(checkpoint, scenario_inputs):
    return scenario_inputs[checkpoint][1]


@pytest.fixture(scope="module")
def batches(checkpoint, scenario_inputs):
    return scenario_inputs[checkpoint][2]


@pytest.fixture(scope="module")
def runs(checkpoint, all_runs):
    """{tp: [record of rank 0, ...]} of this checkpoint's scenario (its failure fails its tests only)."""
    return checkpoint_records(all_runs, checkpoint, "trainer scenario")


@pytest.fixture(scope="module")
def tp4_base_logits(scenario_inputs) -> dict[str, dict]:
    """Base logits at TP=4 of every checkpoint whose KV heads TP=4 divides: one group of 4 processes for all."""
    from support.local_group import run_local

    runs = {checkpoint: (str(path), 4, probe) for checkpoint, (path, probe, _) in scenario_inputs.items()
            if not _kv_heads(path) % 4}
    return run_local(base_logits_per_checkpoint, 4, runs, timeout=300 * len(runs))[0]


def _kv_heads(path) -> int:
    config = json.loads((Path(path) / "config.json").read_text())
    return config.get("num_key_value_heads", config["num_attention_heads"])


def _peft_model(model_path, adapter_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32)
    return PeftModel.from_pretrained(base, str(adapter_dir)).eval()


def test_tp2_equals_tp1_losses_and_grads_over_steps(runs):
    one, two = runs[1][0], runs[2][0]
    assert max_diff(one["init_tensors"]["a"], two["init_tensors"]["a"]) == 0.0  # same seeded A on any TP
    assert abs(one["isolation_metrics"]["loss"] - two["isolation_metrics"]["loss"]) < TOL
    assert len(one["steps"]) == FUSED_STEPS >= 3
    for step_one, step_two in zip(one["steps"], two["steps"]):
        for task_id in TASKS:
            m1, m2 = step_one["metrics"][task_id], step_two["metrics"][task_id]
            for key in ("loss", "clip_frac", "ratio_mean", "grad_norm", "tokens"):
                assert abs(m1[key] - m2[key]) < TOL * max(1.0, abs(m1[key])), (task_id, key, m1[key], m2[key])
            assert max_diff(step_one["grads"][task_id], step_two["grads"][task_id]) < TOL
    last = one["steps"][-1]
    assert all(last["grads"]["a"][k].abs().max() > 0 for k in last["grads"]["a"])
    assert 0 < last["metrics"]["a"]["clip_frac"] < 1 and last["metrics"]["a"]["kl"] > 0
    for task_id in TASKS:
        # Adam divides by sqrt(v): gradients equal to 1e-5 may still move near-zero-gradient weights by
        # ~1e-4 differently, so the weights after 4 steps get a looser bound than losses and gradients
        assert max_diff(one["tensors"][task_id], two["tensors"][task_id]) < 1e-3
        assert one["versions"][task_id] == two["versions"][task_id] == FUSED_STEPS + (task_id == "a")


@pytest.mark.parametrize("tp", [1, 2])
def test_megatron_forward_equals_transformers(runs, hf_base, probe, tp):
    with torch.no_grad():
        reference = hf_base(input_ids=torch.tensor(probe)).logits
    record = runs[tp][0]
    assert record["base_logits"].shape == reference.shape  # [b, s, vocab]: the padding rows are cut off
    assert float((record["base_logits"] - reference).abs().max()) <= LOGIT_TOL
    assert record["shims_idempotent"]


@pytest.mark.parametrize("tp", [1, 2])
def test_megatron_rope_equals_transformers(runs, hf_base, tp):
    """The RoPE frequencies themselves, Llama 3's scaled ones included (a plain RoPE differs by up to x32)."""
    reference = hf_base.model.rotary_emb.inv_freq.float()
    assert torch.allclose(runs[tp][0]["rope_inv_freq"], reference, rtol=1e-6, atol=0)


def test_megatron_forward_equals_transformers_at_tp4(checkpoint, hf_base, probe, tp4_base_logits):
    """TP=4 divides the real checkpoints' 8 heads and 4 KV heads; their vocabulary is padded to 152,064."""
    if hf_base.config.num_key_value_heads % 4:
        pytest.skip("TP=4 does not divide this checkpoint's KV heads")
    with torch.no_grad():
        reference = hf_base(input_ids=torch.tensor(probe)).logits
    record = tp4_base_logits[checkpoint]
    assert "error" not in record, record.get("error")
    assert float((record["base_logits"] - reference).abs().max()) <= LOGIT_TOL


@pytest.mark.parametrize("tp", [1, 2])
def test_training_one_task_leaves_others_and_base_untouched(runs, tp):
    for rank_record in runs[tp]:  # every TP rank checks its own shards
        assert rank_record["others_untouched"] and rank_record["others_no_grad"]
        assert rank_record["isolation_b"]
        assert rank_record["base_untouched"]


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("task_id", list(TASKS))
def test_exported_adapter_reproduces_trainer_logits_in_peft(runs, model_path, hf_base, probe, tp, task_id):
    from safetensors.torch import load_file

    from marlaas_hpc.trainer.lora import peft_key

    record = runs[tp][0]
    export = record["exports"][task_id]
    lora, _ = TASKS[task_id]
    config = json.loads(open(f"{export}/adapter_config.json").read())
    assert (config["r"], config["lora_alpha"], config["task_type"]) == (lora.rank, lora.alpha, "CAUSAL_LM")
    assert sorted(config["target_modules"]) == sorted(lora.target_modules)
    tensors = load_file(f"{export}/adapter_model.safetensors")
    layers = hf_base.config.num_hidden_layers
    expected = {peft_key(layer, m, w) for layer in range(layers) for m in lora.target_modules for w in "AB"}
    assert set(tensors) == expected  # a subset of targets exports only those modules
    assert all(tensors[k].abs().max() > 0 for k in tensors if "lora_B" in k)  # trained: B is non-zero
    with torch.no_grad():
        peft_logits = _peft_model(model_path, export)(input_ids=torch.tensor(probe)).logits
    assert float((record["logits"][task_id] - peft_logits).abs().max()) <= LOGIT_TOL
    assert float((record["logits"][task_id] - record["base_logits"]).abs().max()) > 1e-3  # the adapter acts


@pytest.mark.parametrize("tp", [1, 2])
def test_logprobs_match_peft_and_mixed_rows(runs, batches, model_path, tp):
    from marlaas_hpc.trainer.objectives import token_logprobs

    record = runs[tp][0]
    mixed = record["mixed_logits"]
    assert float((mixed[0] - record["logits"]["a"][0]).abs().max()) < TOL  # row 0 uses a
    assert float((mixed[1] - record["base_logits"][1]).abs().max()) < TOL  # row 1 uses the base only
    for task_id, per_traj in record["logprobs"].items():  # the DESIGN §4 oracle, at the task's temperature
        temperature = TASKS[task_id][1].temperature
        peft = _peft_model(model_path, record["exports"][task_id])
        for traj, logprobs in zip(batches[task_id], per_traj):
            with torch.no_grad():  # teacher forcing, one unpadded row
                logits = peft(input_ids=torch.tensor([traj.prompt_ids + traj.completion_ids])).logits[0]
            reference = token_logprobs(logits[len(traj.prompt_ids) - 1:-1], torch.tensor(traj.completion_ids),
                                       temperature).tolist()
            assert len(logprobs) == len(traj.completion_ids)
            assert max(abs(x - y) for x, y in zip(logprobs, reference)) < TOL


@pytest.mark.parametrize("tp", [1, 2])
def test_state_dict_resume_and_adapter_import(runs, tp):
    for rank_record in runs[tp]:
        assert rank_record["resume_same_loss"] and rank_record["resume_same_weights"]
        assert rank_record["imported_logits_diff"] < 1e-6
        assert sorted(rank_record["task_ids"]) == sorted(TASKS)
