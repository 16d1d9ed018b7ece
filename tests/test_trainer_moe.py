"""The trainer on Qwen3-MoE checkpoints (trainer/moe.py) equals transformers (+PEFT) at TP=1 and TP=2 (gloo).

Three checkpoints, each run at TP=1 and TP=2 in spawned processes (tests/support/moe_scenarios.py):
- `random:qwen3-30b-a3b-mini`, the project's builder (model/random_checkpoints.py): Qwen3's 151,936-row
  vocabulary, untied, every layer routed, top-2 of 8 renormalised (norm_topk_prob), as Qwen3-30B-A3B;
- `hf`, written here with transformers' own Qwen3MoeForCausalLM.save_pretrained (none of the project's
  builders), its config.json then put in the published checkpoints' form (`num_experts`, `rope_theta`), with a
  dense MLP in layer 1 (`mlp_only_layers`) and the top-k weights not renormalised (norm_topk_prob false);
- `hf-fused`, the same weights saved as transformers 5 holds them in memory (3D `mlp.experts.gate_up_proj`,
  `mlp.experts.down_proj`), which its save_pretrained does not write (it writes per-expert tensors).
"""
from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path

import pytest
import torch

from support.checks import max_diff
from support.local_group import checkpoint_records, run_at_tp1_and_tp2
from support.moe_scenarios import (ALGO, EXPERT_LORA, HF_VOCAB, LORA, STEPS, forced_gates, hf_model, moe_batch,
                                   moe_per_checkpoint, moe_probe, write_hf_moe_checkpoint)

LOGIT_TOL = 1e-4
"""Trainer vs transformers, fp32 (logits and logprobs)."""
TP_TOL = 1e-5
"""TP=2 vs TP=1 losses and gradients."""
CHECKPOINTS = ["random:qwen3-30b-a3b-mini", "hf", "hf-fused"]
pytestmark = pytest.mark.slow


def _write_fused(source: Path, out: Path) -> Path:
    """The same model with its experts in transformers 5's in-memory 3D form."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32)
    out.mkdir()
    shutil.copy(source / "config.json", out / "config.json")
    tensors = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in tensors
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, tuple]:
    """Per checkpoint: (path, probe rows, batch, batch with shifted routes)."""
    from marlaas_hpc.model.random_checkpoints import ensure_random_checkpoint

    root = tmp_path_factory.mktemp("moe_checkpoints")
    hf = write_hf_moe_checkpoint(root / "hf", HF_VOCAB)
    paths = {"random:qwen3-30b-a3b-mini": ensure_random_checkpoint("qwen3-30b-a3b-mini"), "hf": hf,
             "hf-fused": _write_fused(hf, root / "hf-fused")}
    out = {}
    for checkpoint, path in paths.items():
        hf_base = hf_model(path)
        out[checkpoint] = (path, moe_probe(hf_base.config.vocab_size), *moe_batch(hf_base))
    return out


@pytest.fixture(scope="module")
def all_runs(inputs, tmp_path_factory) -> dict[str, dict[int, list[dict]]]:
    """{checkpoint: {tp: [record of each rank]}}: one process for TP=1 and a pair for TP=2, concurrently."""
    out_dir = tmp_path_factory.mktemp("moe_exports")
    runs = {tp: {c: (str(path), tp, probe, batch, str(out_dir / c.replace(":", "_")), shifted)
                 for c, (path, probe, batch, shifted) in inputs.items()} for tp in (1, 2)}
    return run_at_tp1_and_tp2(moe_per_checkpoint, runs, timeout=300 * len(CHECKPOINTS))


@pytest.fixture(scope="module", params=CHECKPOINTS)
def checkpoint(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def runs(checkpoint, all_runs):
    return checkpoint_records(all_runs, checkpoint, "MoE scenario")


@pytest.fixture(scope="module")
def hf_base(checkpoint, inputs):
    return hf_model(inputs[checkpoint][0])


@pytest.mark.parametrize("tp", [1, 2])
def test_moe_forward_equals_transformers(runs, hf_base, checkpoint, inputs, tp):
    probe = inputs[checkpoint][1]
    with torch.no_grad():
        reference = hf_base(input_ids=torch.tensor(probe)).logits
    got = runs[tp][0]["base_logits"]
    assert got.shape == reference.shape
    diff = float((got - reference).abs().max())
    print(f"{checkpoint} TP={tp}: max |logit diff| {diff:.2e}")
    assert diff <= LOGIT_TOL


@pytest.mark.parametrize("tp", [1, 2])
def test_moe_logprobs_equal_transformers(runs, hf_base, checkpoint, inputs, tp):
    """The trainer's packed logprobs (prompt once, completions after it) against HF teacher forcing per row."""
    from marlaas_hpc.trainer.objectives import token_logprobs

    worst = 0.0
    for key, temperature in (("base_logprobs", 1.0), ("base_logprobs_t07", 0.7)):
        for traj, logprobs in zip(inputs[checkpoint][2], runs[tp][0][key]):
            with torch.no_grad():
                logits = hf_base(input_ids=torch.tensor([traj.prompt_ids + traj.completion_ids])).logits[0]
            reference = token_logprobs(logits[len(traj.prompt_ids) - 1:-1], torch.tensor(traj.completion_ids),
                                       temperature).tolist()
            assert len(logprobs) == len(reference)
            worst = max(worst, max(abs(x - y) for x, y in zip(logprobs, reference)))
    print(f"{checkpoint} TP={tp}: max |logprob diff| {worst:.2e}")
    assert worst <= LOGIT_TOL


def _hf_logprobs(hf_base, traj, routes=None) -> list[float]:
    """transformers' logprobs of the completion, its routers forced to `routes` when given."""
    from marlaas_hpc.trainer.objectives import token_logprobs

    ids = traj.prompt_ids + traj.completion_ids
    with torch.no_grad(), (forced_gates(hf_base, routes) if routes is not None else contextlib.nullcontext()):
        logits = hf_base(input_ids=torch.tensor([ids])).logits[0]
    return token_logprobs(logits[len(traj.prompt_ids) - 1:-1], torch.tensor(traj.completion_ids), 1.0).tolist()


def _worst(got: list[list[float]], want: list[list[float]]) -> float:
    assert [len(row) for row in got] == [len(row) for row in want]
    return max(abs(x - y) for g, w in zip(got, want) for x, y in zip(g, w))


@pytest.mark.parametrize("tp", [1, 2])
def test_moe_replaying_transformers_routes_gives_its_logprobs(runs, hf_base, checkpoint, inputs, tp):
    """Routing replay (trainer/route_replay.py) given the experts transformers' own routers chose, prompt and
    completion positions: the trainer's logprobs are transformers'."""
    batch = inputs[checkpoint][2]
    worst = _worst(runs[tp][0]["replay_logprobs"], [_hf_logprobs(hf_base, traj) for traj in batch])
    print(f"{checkpoint} TP={tp} replay of HF's routes: max |logprob diff| {worst:.2e}")
    assert worst <= LOGIT_TOL


@pytest.mark.parametrize("tp", [1, 2])
def test_moe_replay_routes_through_the_given_experts(runs, hf_base, checkpoint, inputs, tp):
    """Replay is not a no-op: routed through every token's 2nd..k+1-th experts, the trainer's logprobs move away
    from transformers' own and equal transformers' with its routers forced to those experts (weights: its
    softmax at them, renormalised when norm_topk_prob)."""
    batch, shifted = inputs[checkpoint][2], inputs[checkpoint][3]
    got = runs[tp][0]["shifted_logprobs"]
    forced = [_hf_logprobs(hf_base, traj, traj.routes) for traj in shifted]
    moved, worst = _worst(got, [_hf_logprobs(hf_base, traj) for traj in batch]), _worst(got, forced)
    print(f"{checkpoint} TP={tp} replay of the next experts: {moved:.2e} from HF's own, {worst:.2e} from HF forced")
    assert moved > 100 * LOGIT_TOL and worst <= LOGIT_TOL


@pytest.mark.parametrize("tp", [1, 2])
def test_moe_route_mismatch_counts_the_trained_tokens_the_trainer_routes_otherwise(runs, tp):
    """`route_mismatch` of a replaying task's step: 0 on the experts transformers chose (the trainer's own top k
    agrees), 1 on the 2nd..k+1-th (its own top k of the first MoE layer differs for every token)."""
    steps = runs[tp][0]["replay_steps"]
    assert steps["own"]["route_mismatch"] == 0.0 and steps["next"]["route_mismatch"] == 1.0, steps


def test_moe_tp2_equals_tp1_losses_and_grads(runs):
    one, two = runs[1][0], runs[2][0]
    assert len(one["steps"]) == STEPS
    for step_one, step_two in zip(one["steps"], two["steps"]):
        for task in ("a", "e"):
            for key in ("loss", "grad_norm", "kl", "tokens"):
                m1, m2 = step_one[task]["metrics"][key], step_two[task]["metrics"][key]
                assert abs(m1 - m2) < TP_TOL * max(1.0, abs(m1)), (task, key, m1, m2)
            assert max_diff(step_one[task]["grads"], step_two[task]["grads"]) < TP_TOL
    assert all(one["steps"][-1]["a"]["grads"][k].abs().max() > 0 for k in one["steps"][-1]["a"]["grads"])
    expert_grads = [v for k, v in one["steps"][-1]["e"]["grads"].items() if ".mlp.experts." in k]
    assert expert_grads and sum(float(g.abs().max() > 0) for g in expert_grads) > len(expert_grads) / 2


@pytest.mark.parametrize("tp", [1, 2])
def test_moe_base_stays_frozen_without_aux_loss(runs, tp):
    """No load-balancing / z-loss term reaches the RL loss (megatron attaches them through MoEAuxLossAutoScaler),
    no base weight (router included) gets a gradient or changes."""
    for record in runs[tp]:
        assert record["aux_loss_calls"] == 0
        assert record["router_grads"] == []
        assert record["base_untouched"]


def test_moe_missing_target_is_refused_naming_the_field(runs):
    refusal = runs[1][0]["refusal"]
    assert refusal is not None and "target_modules" in refusal and "w1" in refusal, refusal


@pytest.mark.parametrize("tp", [1, 2])
def test_moe_one_adapter_per_row(runs, tp):
    """Rows of one forward on different adapters (the expert sites find each routed token's row) equal each
    adapter's forward alone."""
    record = runs[tp][0]
    mixed = record["mixed_logits"]
    assert float((mixed[0] - record["logits"]["e"][0]).abs().max()) <= TP_TOL
    assert float((mixed[1] - record["logits"]["a"][1]).abs().max()) <= TP_TOL


@pytest.mark.parametrize("tp", [1, 2])
def test_moe_expert_adapter_loads_back_into_the_trainer(runs, tp):
    record = runs[tp][0]
    assert float((record["reloaded_logits"] - record["logits"]["e"]).abs().max()) <= TP_TOL


@pytest.mark.parametrize("tp", [1, 2])
def test_moe_attention_adapter_loads_in_plain_peft(runs, checkpoint, inputs, tp):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from marlaas_hpc.trainer.lora import peft_key

    record = runs[tp][0]
    tensors = load_file(f"{record['export']['a']}/adapter_model.safetensors")
    layers = json.loads((Path(inputs[checkpoint][0]) / "config.json").read_text())["num_hidden_layers"]
    assert set(tensors) == {peft_key(layer, m, w) for layer in range(layers) for m in LORA.target_modules
                            for w in "AB"}
    base = AutoModelForCausalLM.from_pretrained(str(inputs[checkpoint][0]), dtype=torch.float32)
    peft = PeftModel.from_pretrained(base, record["export"]["a"]).eval()
    with torch.no_grad():
        reference = peft(input_ids=torch.tensor(inputs[checkpoint][1])).logits
    assert float((record["logits"]["a"] - reference).abs().max()) <= LOGIT_TOL
    assert float((record["logits"]["a"] - record["base_logits"]).abs().max()) > 1e-3  # the adapter acts
    assert ALGO.kl_beta > 0 and record["steps"][-1]["a"]["metrics"]["kl"] > 0


def _expert_adapter_keys(config: dict) -> set[str]:
    """The keys of a default-target adapter on a Qwen3-MoE: attention everywhere, every expert's gate/up/down in a
    routed layer (the per-expert form), none on a dense layer's MLP (PEFT on transformers 5 would not load it)."""
    from marlaas_hpc.model.families import experts_of
    from marlaas_hpc.trainer.lora import expert_peft_key, peft_key

    spec = experts_of(config)
    keys = set()
    for layer, routed in enumerate(spec.expert_layers):
        keys |= {peft_key(layer, m, w) for m in ("q_proj", "k_proj", "v_proj", "o_proj") for w in "AB"}
        if routed:
            keys |= {expert_peft_key(layer, n, part, w) for part in ("gate_proj", "up_proj", "down_proj")
                     for n in range(spec.num_experts) for w in "AB"}
    return keys


def _peft_model(base_path, adapter):
    from peft import PeftModel

    return PeftModel.from_pretrained(hf_model(base_path), str(adapter)).eval()


@pytest.mark.parametrize("tp", [1, 2])
def test_moe_expert_adapter_loads_in_plain_peft(runs, checkpoint, inputs, tp, tmp_path):
    """The default-target adapter (experts included) loads in transformers 5.19 + PEFT with every LoRA key used,
    and computes the trainer's logprobs; with its expert LoRA zeroed it does not (the experts' part counts)."""
    from safetensors.torch import load_file, save_file

    from marlaas_hpc.trainer.objectives import token_logprobs

    record = runs[tp][0]
    export, (path, probe, batch, _) = Path(record["export"]["e"]), inputs[checkpoint]
    tensors = load_file(str(export / "adapter_model.safetensors"))
    assert set(tensors) == _expert_adapter_keys(json.loads((Path(path) / "config.json").read_text()))
    assert max(float(v.abs().max()) for k, v in tensors.items() if ".mlp.experts." in k and "lora_B" in k) > 0
    peft = _peft_model(path, export)
    loaded = peft.load_adapter(str(export), adapter_name="check")
    assert [k for k in loaded.missing_keys if "lora_" in k] == [] and loaded.unexpected_keys == []
    worst = 0.0
    for traj, trained in zip(batch, record["logprobs_e"]):
        with torch.no_grad():
            logits = peft(input_ids=torch.tensor([traj.prompt_ids + traj.completion_ids])).logits[0]
        reference = token_logprobs(logits[len(traj.prompt_ids) - 1:-1], torch.tensor(traj.completion_ids), 1.0)
        worst = max(worst, max(abs(x - y) for x, y in zip(trained, reference.tolist())))
    with torch.no_grad():
        logits_diff = float((peft(input_ids=torch.tensor(probe)).logits - record["logits"]["e"]).abs().max())
    print(f"{checkpoint} TP={tp} expert LoRA: max |logprob diff| {worst:.2e}, max |logit diff| {logits_diff:.2e}")
    assert worst <= LOGIT_TOL and logits_diff <= LOGIT_TOL
    without = tmp_path / "no-experts"
    shutil.copytree(export, without)
    save_file({k: torch.zeros_like(v) if ".mlp.experts." in k and "lora_B" in k else v for k, v in tensors.items()},
              str(without / "adapter_model.safetensors"))
    with torch.no_grad():
        ignored = _peft_model(path, without)(input_ids=torch.tensor(probe)).logits
    ignored_diff = float((ignored - record["logits"]["e"]).abs().max())
    print(f"{checkpoint} TP={tp}: expert LoRA B zeroed, max |logit diff| {ignored_diff:.2e}")
    assert ignored_diff > 100 * LOGIT_TOL


def test_moe_expert_adapter_keys_are_what_vllm_reads(runs, checkpoint, inputs):
    """Stock vLLM 0.32 reads Qwen3-MoE expert LoRA per expert (its 2D `FusedMoEWithLoRA`: Qwen3MoeForCausalLM has
    no `is_3d_moe_weight`): its own loader takes the export with the modules its worker expects, one per expert
    and projection (pack_moe then stacks them; it runs on GPU only, not here)."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    from vllm.model_executor.models.qwen3_moe import Qwen3MoeForCausalLM

    from marlaas_hpc.model.families import experts_of

    config = json.loads((Path(inputs[checkpoint][0]) / "config.json").read_text())
    spec = experts_of(config)
    assert not Qwen3MoeForCausalLM.is_3d_moe_weight
    # what vLLM's worker expects (worker_manager._load_adapter): packed qkv_proj's parts, dense MLPs' parts, and
    # the "experts" packing of Qwen3-MoE's expert mapping
    per_expert = {name.rstrip(".") for _, name, _, _ in RoutedExperts.build_expert_params_mapping(
        "gate_proj", "down_proj", "up_proj", spec.num_experts, routed_experts_prefix="")}
    expected = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "experts", *per_expert}
    export = runs[1][0]["export"]["e"]
    lora = LoRAModel.from_local_checkpoint(export, expected, PEFTHelper.from_local_dir(export, None), device="cpu",
                                           dtype=torch.float32,
                                           weights_mapper=Qwen3MoeForCausalLM.hf_to_vllm_mapper.get_rename_mapper())
    routed = [layer for layer, is_routed in enumerate(spec.expert_layers) if is_routed]
    want = {f"model.layers.{layer}.mlp.experts.{n}.{part}" for layer in routed for n in range(spec.num_experts)
            for part in ("gate_proj", "up_proj", "down_proj")}
    assert want <= set(lora.loras)
    one = lora.loras[f"model.layers.{routed[0]}.mlp.experts.0.gate_proj"]
    assert one.lora_a.shape == (EXPERT_LORA.rank, config["hidden_size"]) and one.scaling == EXPERT_LORA.scaling


def test_moe_expert_adapter_in_memory_on_the_hf_engine(runs, checkpoint, inputs):
    """The rollout path without a directory: the `hf` engine takes the trainer's tensors as broadcast (PEFT's
    set_peft_model_state_dict converts the per-expert form) and computes the trainer's logits."""
    from safetensors.torch import load_file

    from marlaas_hpc.rollout.base import AdapterRef
    from marlaas_hpc.rollout.hf_engine import HfEngine

    if not (Path(inputs[checkpoint][0]) / "tokenizer_config.json").is_file():
        pytest.skip("the engine needs a tokenizer: only the random checkpoint has one")
    record = runs[2][0]
    engine = HfEngine(inputs[checkpoint][0], device="cpu")
    tensors = load_file(f"{record['export']['e']}/adapter_model.safetensors")
    engine.add_adapter(AdapterRef("e", 1, tensors=tensors, lora=EXPERT_LORA))
    engine.model.set_adapter(engine.adapter_name("e", 1))
    with torch.no_grad():
        logits = engine.model(input_ids=torch.tensor(inputs[checkpoint][1])).logits
    assert float((logits - record["logits"]["e"]).abs().max()) <= LOGIT_TOL


def test_moe_hf_engine_serves_several_adapters_in_one_step(runs, checkpoint, inputs):
    """Rollouts of a two-task MoE job on the `hf` engine: an expert adapter, an attention adapter and the base
    model (a task's eval before training) in one step. PEFT's wrapper of the fused experts takes no mixed batch
    (it raises), so the engine batches per adapter; each row's greedy tokens and logprobs are those of its
    adapter served alone."""
    from marlaas_hpc.rollout.base import AdapterRef, GenerationRequest
    from marlaas_hpc.rollout.hf_engine import HfEngine

    if not (Path(inputs[checkpoint][0]) / "tokenizer_config.json").is_file():
        pytest.skip("the engine needs a tokenizer: only the random checkpoint has one")
    record, prompt = runs[1][0], inputs[checkpoint][1][0][:12]
    adapters = {"e": (1, EXPERT_LORA), "a": (1, LORA), "base": (None, None)}

    def engine_with(tasks):
        engine = HfEngine(inputs[checkpoint][0], device="cpu")
        for task in tasks:
            version, lora = adapters[task]
            if version is not None:
                engine.add_adapter(AdapterRef(task, version, path=record["export"][task], lora=lora))
        return engine

    def request(task):
        return GenerationRequest(request_id=task, task_id=task, adapter_version=adapters[task][0],
                                 prompt_ids=prompt, temperature=0.0, max_new_tokens=6, ignore_stop=True)

    together = engine_with(["e", "a"])
    together.submit([request(task) for task in adapters])
    rows = {gen.request_id: gen for gen in together.step()}
    assert set(rows) == set(adapters)
    for task in adapters:
        alone = engine_with([task] if adapters[task][0] is not None else [])
        alone.submit([request(task)])
        (gen,) = alone.step()
        assert rows[task].completion_ids == gen.completion_ids, task
        assert max(abs(x - y) for x, y in zip(rows[task].logprobs, gen.logprobs)) < 1e-5, task
