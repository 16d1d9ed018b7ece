"""The trainer on mixture-of-experts checkpoints (qwen3_moe), one run per TP size in spawned gloo processes; the
tests in tests/test_trainer_moe.py compare its records with transformers / PEFT and with each other."""
from __future__ import annotations

import json
import random
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import torch

from marlaas_hpc.model.families import ATTENTION_PROJECTIONS
from marlaas_hpc.tasks.spec import AlgoSpec, LoraSpec
from marlaas_hpc.trajectory import Trajectory
from support.local_group import per_checkpoint
from support.trainer_scenarios import make_trajectories, probe_ids

LORA = LoraSpec(rank=4, alpha=8.0, target_modules=ATTENTION_PROJECTIONS)
"""Task "a": attention only (a task's explicit choice on an MoE model)."""
EXPERT_LORA = LoraSpec(rank=4, alpha=8.0)
"""Task "e": the default targets, every expert's gate/up/down_proj with the attention projections."""
ALGO = AlgoSpec(lr=5e-3, kl_beta=0.05)
STEPS = 2


def moe_per_checkpoint(rank: int, runs: dict[str, tuple]) -> dict[str, dict]:
    """`moe_scenario` of each checkpoint (args: model_path, tp, probe, batch, out_dir, shifted) in this process."""
    return per_checkpoint(moe_scenario, rank, runs)


def moe_scenario(rank: int, model_path: str, tp: int, probe: list[list[int]], batch: list[Trajectory],
                 out_dir: str, shifted: list[Trajectory]) -> dict:
    """Base logits and logprobs, also routed through `batch`'s recorded routes and `shifted`'s; STEPS fused GRPO
    steps of two tasks in one batch (an attention LoRA "a" and a default-target one "e", experts included) with
    megatron's aux-loss hook watched; the trained adapters' logits (one adapter per row too), "e"'s logprobs, both
    PEFT exports, "e" loaded back from its export; a target the model lacks refused; one step of two replaying
    tasks (`_replay_steps`)."""
    from megatron.core.transformer.moe import moe_utils

    from marlaas_hpc.trainer.trainer import MultiLoraTrainer, TrainerConfig

    trainer = MultiLoraTrainer(TrainerConfig(model_path=model_path, tensor_parallel=tp, seed=7, dtype="float32"))
    base_before = {k: v.detach().clone() for k, v in trainer.model.state_dict().items() if torch.is_tensor(v)}
    record: dict = {"base_logits": trainer.logits(None, probe), "base_logprobs": trainer.logprobs(None, batch),
                    "base_logprobs_t07": trainer.logprobs(None, batch, 0.7),
                    "replay_logprobs": trainer.logprobs(None, batch, replay=True),
                    "shifted_logprobs": trainer.logprobs(None, shifted, replay=True)}
    trainer.add_task("a", LORA, ALGO)
    trainer.add_task("e", EXPERT_LORA, ALGO)
    batches = {"a": batch, "e": [replace(traj, task_id="e", group_id="e" + traj.group_id) for traj in batch]}
    aux_calls = [0]
    apply = moe_utils.MoEAuxLossAutoScaler.apply

    def counting_apply(*args):
        aux_calls[0] += 1
        return apply(*args)

    moe_utils.MoEAuxLossAutoScaler.apply = counting_apply
    try:
        record["steps"] = []
        for _ in range(STEPS):
            metrics = trainer.train_steps(batches)
            record["steps"].append({t: {"metrics": metrics[t], "grads": trainer.adapter_tensors(t, grads=True)}
                                    for t in batches})
    finally:
        moe_utils.MoEAuxLossAutoScaler.apply = apply
    record["aux_loss_calls"] = aux_calls[0]
    base_after = {k: v.detach() for k, v in trainer.model.state_dict().items() if torch.is_tensor(v)}
    record["base_untouched"] = base_before.keys() == base_after.keys() and all(
        torch.equal(base_before[k], base_after[k]) for k in base_before)
    record["router_grads"] = [name for name, param in trainer.model.named_parameters() if param.grad is not None]
    record["logits"] = {t: trainer.logits(t, probe) for t in batches}
    record["mixed_logits"] = trainer.logits(["e", "a"], probe)
    record["logprobs_e"] = trainer.logprobs("e", batches["e"])
    record["export"] = {t: str(trainer.export_adapter(t, Path(out_dir) / f"tp{tp}-{t}")) for t in batches}
    trainer.load_adapter("e-reloaded", record["export"]["e"], ALGO)
    record["reloaded_logits"] = trainer.logits("e-reloaded", probe)
    try:
        trainer.add_task("x", LoraSpec(rank=2, target_modules=("q_proj", "w1")), ALGO)
        record["refusal"] = None
    except ValueError as exc:
        record["refusal"] = str(exc)
    record["replay_steps"] = _replay_steps(trainer, batch, shifted)
    trainer.close()
    return record


def _replay_steps(trainer, batch: list[Trajectory], shifted: list[Trajectory]) -> dict[str, dict]:
    """One fused step of two replaying tasks: "own" on the experts transformers chose, "next" on the 2nd..k+1-th."""
    algo = replace(ALGO, routing_replay=True)
    batches = {"own": batch, "next": shifted}
    for task_id in batches:
        trainer.add_task(task_id, EXPERT_LORA, algo)
    return trainer.train_steps({task_id: [replace(traj, task_id=task_id) for traj in trajs]
                                for task_id, trajs in batches.items()})


def write_hf_moe_checkpoint(out: Path, vocab_size: int) -> Path:
    """A Qwen3-MoE written by transformers itself (none of the project's builders), config.json then rewritten with
    the published checkpoints' key names (`num_experts`, `rope_theta`); a dense MLP in layer 1 (`mlp_only_layers`),
    top-k weights not renormalised (norm_topk_prob false)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(11)
    config = Qwen3MoeConfig(vocab_size=vocab_size, hidden_size=128, intermediate_size=192, moe_intermediate_size=64,
                            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                            num_experts=8, num_experts_per_tok=2, norm_topk_prob=False, mlp_only_layers=[1],
                            decoder_sparse_step=1, tie_word_embeddings=False, max_position_embeddings=512,
                            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0})
    model = Qwen3MoeForCausalLM(config).float()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(1.0, 0.1)
            elif name.endswith("mlp.gate.weight"):  # decisive routing: no near-tie for a last bit to flip
                param.normal_(0.0, 0.3)
    model.save_pretrained(str(out))
    published = json.loads((out / "config.json").read_text())
    published["num_experts"] = published.pop("num_local_experts")
    published["rope_theta"] = published.pop("rope_parameters")["rope_theta"]
    (out / "config.json").write_text(json.dumps(published, indent=2))
    return out


def write_served_moe_checkpoint(out: Path) -> Path:
    """transformers' own Qwen3-MoE at Qwen3's vocabulary, with the random Qwen3-MoE's BPE tokenizer and eos list: a
    checkpoint a job can serve that none of the project's builders wrote."""
    import shutil

    from marlaas_hpc.model.random_checkpoints import ensure_random_checkpoint

    tokenizer = ensure_random_checkpoint("qwen3-30b-a3b-mini")
    vocab = json.loads((tokenizer / "config.json").read_text())["vocab_size"]
    path = write_hf_moe_checkpoint(out, vocab)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        shutil.copy(tokenizer / name, path / name)
    return path


def ranked_routes(model, ids: list[int], skip: int):
    """transformers' experts for each position of `ids` but the last (what an engine records), taking the choices
    ranked skip + 1 .. skip + k of every MoE layer's router (skip 0: its own top k): int16 [len - 1, layers, k]."""
    from marlaas_hpc.rollout.routes import moe_gates

    gates = moe_gates(model)
    logits: list[torch.Tensor] = []
    handles = [gate.register_forward_hook(lambda m, i, out: logits.append(out[0].detach())) for gate in gates]
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([ids]))
    finally:
        for handle in handles:
            handle.remove()
    k = gates[0].top_k
    chosen = [torch.topk(layer, skip + k, dim=-1).indices[:, skip:] for layer in logits]
    return torch.stack(chosen, dim=1)[:-1].to(torch.int16).numpy()


@contextmanager
def forced_gates(model, routes):
    """transformers' MoE layers routed to `routes` [positions, layers, k] for the first positions of a one-row
    forward (the rest: their own top k), the weights the router's softmax at those experts, renormalised over
    them when norm_topk_prob (what Qwen3MoeTopKRouter computes for its own choice): the reference of replay."""
    from marlaas_hpc.rollout.routes import moe_gates

    gates = moe_gates(model)
    originals = [gate.forward for gate in gates]

    def forced(gate, layer):
        def forward(hidden_states):
            logits, _, own = originals[layer](hidden_states)
            probs = torch.softmax(logits, dim=-1, dtype=torch.float)
            indices = own.clone()
            given = torch.as_tensor(routes[:, layer]).long()
            indices[: len(given)] = given
            weights = probs.gather(1, indices)
            if gate.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return logits, weights.to(logits.dtype), indices
        return forward

    for layer, gate in enumerate(gates):
        gate.forward = forced(gate, layer)
    try:
        yield model
    finally:
        for gate, original in zip(gates, originals):
            gate.forward = original


# ------------------------------------------------------------------ inputs of the MoE trainer tests
HF_VOCAB = 1024
"""The vocabulary of the checkpoint `write_hf_moe_checkpoint` writes in the trainer tests."""


def hf_model(path):
    """The checkpoint in plain transformers, fp32, eval mode."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def moe_batch(hf_base) -> tuple[list, list]:
    """Trajectories with behaviour logprobs = HF's + noise, group-relative advantages and the routes HF chose (a
    task without replay ignores them); the same with each token's next k experts as routes (`ranked_routes`)."""
    from marlaas_hpc.trainer.objectives import token_logprobs
    from marlaas_hpc.trajectory import assign_advantages

    noise = random.Random(0)
    trajs = make_trajectories("a", seed=5, vocab=hf_base.config.vocab_size)
    for traj in trajs:
        with torch.no_grad():
            logits = hf_base(input_ids=torch.tensor([traj.prompt_ids + traj.completion_ids])).logits[0]
        logp = token_logprobs(logits[len(traj.prompt_ids) - 1:-1], torch.tensor(traj.completion_ids), 1.0)
        traj.behaviour_logprobs = [v + noise.gauss(0.0, 0.1) if m else 0.0 for v, m in zip(logp.tolist(), traj.mask())]
        traj.routes = ranked_routes(hf_base, traj.prompt_ids + traj.completion_ids, 0)
    assign_advantages(trajs)
    shifted = [replace(traj, routes=ranked_routes(hf_base, traj.prompt_ids + traj.completion_ids, 1))
               for traj in trajs]
    return trajs, shifted


def moe_probe(vocab: int) -> list[list[int]]:
    """Probe rows: the trainer tests' own, or two random rows of the small vocabulary of `write_hf_moe_checkpoint`."""
    if vocab != HF_VOCAB:
        return probe_ids(vocab)
    rng = random.Random(3)
    return [[rng.randrange(vocab) for _ in range(48)] for _ in range(2)]
