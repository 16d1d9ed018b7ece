"""`marlaas plan` of a mixture-of-experts model (issue #38): Qwen3-30B-A3B's config.json as published, planned with
every expert on every rank (TP over the experts) or, with expert parallelism (layout.trainer_ep), 1/EP of them a
trainer rank, its per-task adapter counted from first principles, the layouts that cannot fit an 80 GB GPU refused
naming the field; and the trainer's base weights of the small random Qwen3-MoE counted from transformers'
parameters as megatron shards them."""
import json
import re
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from marlaas_hpc.config import JobConfig
from marlaas_hpc.config_loader import SpecError
from marlaas_hpc.model.random_checkpoints import SHAPES, hf_config
from marlaas_hpc.plan.command import check_fits, model_dims, trainer_inputs
from marlaas_hpc.plan.estimate import (GIB, adapter_bytes, base_weight_bytes, lora_elements, padded_vocab,
                                       peft_adapter_elements, trainer_memory, vllm_lora_elements)
from support.configs import run_plan as plan, with_changes
from support.published_configs import QWEN3_30B_A3B

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "configs" / "qwen3-0.6b-gsm8k.yaml"
TWO_TASKS = {"layout.trainer_tp": 4, "max_adapters": 2, "trainer_slots": 1, "trainer.micro_batch_tokens": 4096,
               "trainer.recompute": True, "vllm.tensor_parallel_size": 2, "layout.rollout.gpus_per_task": 2,
               "delta.transport": "relay", "layout.rollout.mem": "400G"}
"""Two tasks of rank 32 on every expert: what one 80 GB trainer rank holds at TP 2 and 4 (at TP 2 each task's
float32 adapter is 3.9 GiB a rank, its gradients and AdamW moments 11.7 GiB; the broadcast's 16 in-flight adapter
copies of 6.3 GiB would not fit: the relay's are on the host), and micro-batches of 4096 tokens, recomputed."""

EP4 = {**TWO_TASKS, "layout.trainer_tp": 1, "layout.trainer_dp": 4, "layout.trainer_ep": 4}
"""The two tasks on a group of 4 DP ranks at TP 1, each MoE layer's 128 experts split over them (EP 4)."""


@pytest.fixture
def qwen3_30b(tmp_path) -> Path:
    (tmp_path / "qwen3-30b-a3b").mkdir()
    (tmp_path / "qwen3-30b-a3b" / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    return tmp_path / "qwen3-30b-a3b"


def job_file(tmp_path, model: Path, tasks: int = 8, **changes) -> Path:
    """The shipped GPU config (rank-32 tasks on the seven projections) on `model`, its first `tasks` tasks."""
    data = yaml.safe_load(SHIPPED.read_text())
    data["model"], data["delta"], data["tasks"] = str(model), {}, data["tasks"][:tasks]
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(with_changes(data, changes), sort_keys=False))
    return path


def test_the_adapter_of_every_expert_is_counted_from_first_principles(qwen3_30b):
    dims = model_dims(JobConfig(), str(qwen3_30b))[0]
    r, h, layers, experts, expert_mlp = 32, 2048, 48, 128, 768
    q, kv = 32 * 128, 4 * 128
    # PEFT's form (an export, the delta): per layer q, k, v, o A [r, in] and B [out, r]; per expert gate, up, down
    attention = r * (h + q) + 2 * r * (h + kv) + r * (q + h)
    peft = layers * attention + layers * experts * 3 * r * (h + expert_mlp)
    assert peft_adapter_elements(dims, r) == peft  # 1.69 G elements: 6.29 GiB in float32
    job = JobConfig.load(job_file(Path(qwen3_30b).parent, qwen3_30b)).validate()
    assert adapter_bytes(trainer_inputs(job, dims)) == 4 * peft
    # a trainer rank at TP 2 (trainer/lora.py): qkv A [r, h] whole, B [(q + 2 kv) / 2, r]; proj A [r, q / 2], B
    # [h, r] whole; each expert's fc1 A [r, h] whole, B [2 x 384, r]; fc2 A [r, 384], B [h, r] whole
    shard = expert_mlp // 2
    trainer = layers * (r * (h + (q + 2 * kv) // 2) + r * (q // 2 + h)) \
        + layers * experts * (r * (h + 2 * shard) + r * (shard + h))
    assert lora_elements(dims, 2, r) == trainer
    # a vLLM slot at TP 2 (FusedMoEWithLoRA): per expert w1, w3 A [r, h], B [384, r]; w2 A [r, 384], B [h, r]
    slot = layers * (3 * r * h + r * (q + 2 * kv) // 2 + r * q // 2 + r * h) \
        + layers * experts * r * (3 * h + 3 * shard)
    assert vllm_lora_elements(dims, 2, r) == slot


@pytest.mark.parametrize("tp", [2, 4])
def test_every_trainer_and_rollout_rank_is_printed_with_every_expert_at_tp(tmp_path, qwen3_30b, capsys, tp):
    code, out, err = plan(capsys, job_file(tmp_path, qwen3_30b, tasks=2, **{**TWO_TASKS, "layout.trainer_tp": tp}))
    assert f"trainer rank x{tp} (layout.trainer_tp {tp}" in out
    assert "rollout rank x6 (vllm.tensor_parallel_size 2)" in out
    assert f"base weights (bfloat16): all 128 experts, 1/{tp} of each (no expert parallelism)" in out
    assert "weights (bfloat16): all 128 experts, 1/2 of each (no expert parallelism)" in out
    assert "x (4 attention + 128 experts x 3) projections x 48 layers" in out
    for line in out.splitlines():  # every line of a rank carries its GiB
        assert not line.startswith("  ") or line.startswith("  note:") or " GiB" in line, line
    assert code == 0 and "DOES NOT FIT" not in out, err


def test_the_shipped_eight_tasks_do_not_fit_an_80_gb_trainer_at_tp2(tmp_path, qwen3_30b, capsys):
    """Eight rank-32 tasks on every expert: 31 GiB of adapters and 93 GiB of optimizer state a rank at TP 2; the refusal
    says where the memory goes."""
    code, out, err = plan(capsys, job_file(tmp_path, qwen3_30b, **{"layout.trainer_tp": 2}))
    assert code == 1 and "DOES NOT FIT" in out
    assert "marlaas: layout.trainer_tp: a trainer rank needs" in err and "no single change fits it" in err
    assert "each task's adapter on every expert takes 15.57 GiB a rank with its gradients and AdamW moments, " \
           "8 tasks (max_adapters) 124.59 GiB" in err, err


def test_tp1_holds_61_gb_of_weights_and_is_refused_naming_layout_trainer_tp(tmp_path, qwen3_30b, capsys):
    path = job_file(tmp_path, qwen3_30b, tasks=2, **{**TWO_TASKS, "layout.trainer_tp": 1})
    job = JobConfig.load(path).validate()
    dims = model_dims(job)[0]
    weights = base_weight_bytes(trainer_inputs(job, dims))
    assert 60e9 < weights < 62e9  # 30.5 B parameters in bfloat16, the vocabulary padded, every expert
    with pytest.raises(SpecError) as refused:
        check_fits(job)
    assert refused.value.field == "layout.trainer_tp"
    code, out, err = plan(capsys, path)
    assert code == 1 and "raise layout.trainer_tp to 2" in err, err


def test_the_trainer_weights_of_the_small_moe_are_what_megatron_holds_of_transformers_parameters():
    """random:qwen3-30b-a3b-mini on a meta device: attention and every expert split over TP, the router and the
    norms whole, the embedding and LM head by vocabulary rows padded to 128 x TP (no megatron model built)."""
    import torch
    from transformers import AutoModelForCausalLM

    recipe = SHAPES["qwen3-30b-a3b-mini"]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config(recipe))
    dims = recipe.shape
    assert dims.parameters() == sum(p.numel() for p in model.parameters())
    for tp in (1, 2):
        held = 0
        for name, param in model.named_parameters():
            if "embed_tokens" in name or "lm_head" in name:
                held += padded_vocab(dims, tp) // tp * dims.hidden_size
            elif "mlp.gate." in name or "norm" in name:  # the router and every RMSNorm: whole
                held += param.numel()
            else:  # q/k/v/o and the experts' gate_up / down
                assert "self_attn" in name or "mlp.experts" in name, name
                held += param.numel() // tp
        job = JobConfig.from_dict({"tasks": [{"task_id": "t"}], "layout": {"trainer_tp": tp}})
        inputs = trainer_inputs(job, dims)
        buffers = 4 * dims.head_dim // 2 + (padded_vocab(dims, tp) // tp if padded_vocab(dims, tp) > dims.vocab_size
                                             else 0)  # RoPE frequencies, the LM head's padding mask
        assert base_weight_bytes(inputs) == 2 * held + buffers


def test_the_gpu_dry_run_is_not_offered_for_experts(tmp_path, qwen3_30b, capsys):
    code, out, _ = plan(capsys, job_file(tmp_path, qwen3_30b, tasks=2, **TWO_TASKS), "--dry-run")
    assert code == 0 and "no GPU dry run: it cannot route tokens to experts on fake tensors" in out


# ---------------------------------------------------------------------------------------------- expert parallelism
def printed_gib(out: str, label: str, rank: str = "trainer rank") -> float:
    """The GiB figure of the line starting with `label` in the plan of the first rank kind titled `rank`."""
    plan = out[out.index(rank):]
    line = next(line for line in plan.splitlines() if line.strip().startswith(label))
    return float(re.search(r"(\d+\.\d\d) GiB", line[len(label) + 2:]).group(1))


def test_expert_parallelism_4_puts_a_quarter_of_the_experts_on_each_trainer_rank(tmp_path, qwen3_30b, capsys):
    """TP 1, DP 4, EP 4: every trainer and rollout rank is printed; a trainer rank holds 32 of each layer's 128
    experts (their weights, adapters and optimizer state a quarter of EP 1's), the attention, embeddings and router
    whole, and one MoE layer's all-to-all buffers; the same job at EP 1 holds every expert."""
    path = job_file(tmp_path, qwen3_30b, tasks=2, **EP4)
    code, out, err = plan(capsys, path)
    assert code == 0 and "DOES NOT FIT" not in out, err
    assert "trainer rank x4 (layout.trainer_tp 1, 1 group(s) x 4 DP, layout.trainer_ep 4)" in out
    assert "base weights (bfloat16): 128/4 experts per rank (expert parallelism 4), router whole" in out
    assert "expert dispatch buffers (all-to-all in + out): 4096 tokens x top 8 x hidden 2048" in out
    assert "NCCL buffers: 2 communicator(s) (DP, EP)" in out
    assert "rollout rank x6 (vllm.tensor_parallel_size 2)" in out  # vLLM holds every expert (no EP there)
    for line in out.splitlines():  # every line of a rank carries its GiB
        assert not line.startswith("  ") or line.startswith("  note:") or " GiB" in line, line

    job = JobConfig.load(path).validate()
    dims = model_dims(job)[0]
    ep4 = trainer_inputs(job, dims)
    ep1 = replace(ep4, expert_parallel=1)
    assert ep4.expert_parallel == 4
    experts = 2 * 48 * 128 * 3 * 768 * 2048  # every expert's gate, up and down, bfloat16
    assert base_weight_bytes(ep1) - base_weight_bytes(ep4) == experts - experts // 4
    r = 32  # per expert fc1 A [r, h], B [2 x 768, r]; fc2 A [r, 768], B [h, r] (TP 1: whole)
    expert_lora = 48 * 128 * (r * (2048 + 2 * 768) + r * (768 + 2048))
    assert lora_elements(dims, 1, r, 1) - lora_elements(dims, 1, r, 4) == expert_lora - expert_lora // 4
    memory4, memory1 = trainer_memory(ep4), trainer_memory(ep1)
    assert memory4.optimizer_per_task == 3 * memory4.lora_per_task
    assert memory4.dispatch == 2 * ep4.tokens * 8 * (2048 * 2 + 4 + 8) and memory1.dispatch == 0

    # the printed figures of the same job at EP 1 (one GPU's worth is past 80 GB: refused)
    code1, out1, _ = plan(capsys, job_file(tmp_path, qwen3_30b, tasks=2, **{**EP4, "layout.trainer_ep": 1}))
    assert code1 == 1 and "expert dispatch buffers" not in out1
    assert "base weights (bfloat16): all 128 experts, 1/1 of each (no expert parallelism), router whole" in out1
    weights1, weights4 = printed_gib(out1, "base weights"), printed_gib(out, "base weights")
    assert abs((weights1 - weights4) - 0.75 * experts / GIB) < 0.02, (weights1, weights4)
    total1, total4 = printed_gib(out1, "total"), printed_gib(out, "total")
    assert total4 < 80 < total1, (total1, total4)


def test_a_rank_past_80_gb_at_ep2_is_refused_naming_layout_trainer_ep(tmp_path, qwen3_30b, capsys):
    """Eight tasks at EP 2 do not fit an 80 GB trainer rank: refused naming layout.trainer_ep, with the EP (and
    the DP it needs) at which it fits, and that figure is the plan of the layout it names."""
    changes = {**EP4, "max_adapters": 8, "layout.trainer_dp": 2, "layout.trainer_ep": 2}
    path = job_file(tmp_path, qwen3_30b, **changes)
    with pytest.raises(SpecError) as refused:
        check_fits(JobConfig.load(path).validate())
    assert refused.value.field == "layout.trainer_ep"
    code, out, err = plan(capsys, path)
    assert code == 1 and "DOES NOT FIT" in out
    advice = re.search(r"marlaas: layout\.trainer_ep: a trainer rank needs .*: raise layout\.trainer_ep to 4 and "
                       r"layout\.trainer_dp to 4, a multiple of it \((\d+\.\d\d) GiB\)", err)
    assert advice, err
    _, suggested, _ = plan(capsys, job_file(tmp_path, qwen3_30b, **{**changes, "layout.trainer_dp": 4,
                                                                      "layout.trainer_ep": 4}))
    assert printed_gib(suggested, "total") == float(advice.group(1))


def test_nothing_fitting_at_ep8_is_refused_naming_layout_trainer_ep(tmp_path, qwen3_30b, capsys):
    """The shipped eight tasks (16384-token micro-batches, no recompute, the broadcast's in-flight adapters) at
    EP 8: no single change fits, and the refusal names the EP and what the experts' adapters take a rank."""
    code, out, err = plan(capsys, job_file(tmp_path, qwen3_30b, **{"layout.trainer_tp": 1, "layout.trainer_dp": 8,
                                                                     "layout.trainer_ep": 8}))
    assert code == 1 and "base weights (bfloat16): 128/8 experts per rank (expert parallelism 8)" in out
    assert "marlaas: layout.trainer_ep: a trainer rank needs" in err and "no single change fits it: raise " \
           "layout.trainer_ep (layout.trainer_dp with it)" in err, err
    assert "each task's adapter on its rank's 16 experts takes" in err, err


def test_a_tp_layout_past_its_gpu_is_offered_expert_parallelism_in_its_place(tmp_path, qwen3_30b, capsys):
    """TP 2 on a 40 GiB GPU: TP 4 does not fit, EP 4 at TP 1 (DP 4) does; the change starts at layout.trainer_tp
    (EP runs at TP 1 only) and its figure is that layout's plan."""
    changes = {**TWO_TASKS, "layout.trainer_tp": 2, "layout.trainer.gpu_memory_gib": 40}
    code, out, err = plan(capsys, job_file(tmp_path, qwen3_30b, tasks=2, **changes))
    advice = re.search(r"marlaas: layout\.trainer_tp: .*: trade TP for expert parallelism: set layout\.trainer_tp to "
                       r"1, layout\.trainer_ep to 4 and layout\.trainer_dp to 4, a multiple of it \((\d+\.\d\d) GiB\)",
                       err)
    assert code == 1 and advice, err
    _, suggested, _ = plan(capsys, job_file(tmp_path, qwen3_30b, tasks=2, **{**EP4, "layout.trainer.gpu_memory_gib":
                                                                              40}))
    assert printed_gib(suggested, "total") == float(advice.group(1))


@pytest.mark.parametrize("dense", [False, True])
def test_an_ep_the_model_cannot_split_is_refused_naming_layout_trainer_ep(tmp_path, qwen3_30b, capsys, dense):
    """EP must divide the model's experts (128: not 3), and a dense model has none to split."""
    changes = {**EP4, "layout.trainer_dp": 3, "layout.trainer_ep": 3} if not dense else {**EP4, "layout.trainer_ep": 2}
    path = job_file(tmp_path, qwen3_30b, tasks=2, **changes)
    code, _, err = plan(capsys, path, *(("--model", "random:qwen3-0.6b") if dense else ()))
    reason = "is 2, but the model has no experts" if dense else "must divide the 128 experts of the model, got 3"
    assert code == 2 and f"layout.trainer_ep: {reason}" in err, err
