"""Expert parallelism (trainer/experts_parallel.py): one pair of spawned gloo ranks (DP=2, TP=1) runs each checkpoint's
MoE scenario at EP=1 and then at EP=2 (megatron's parallel state made again in between); tests/test_trainer_ep.py
compares the two and with transformers."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from marlaas_hpc.trajectory import Trajectory
from support.local_group import per_checkpoint
from support.moe_scenarios import ALGO, EXPERT_LORA, LORA, STEPS


def ep_per_checkpoint(rank: int, runs: dict[str, tuple]) -> dict[str, dict]:
    """{checkpoint: {ep: record}} of `ep_scenarios` (args: model_path, probe, batch, out_dir) in this process."""
    return per_checkpoint(ep_scenarios, rank, runs)


def ep_scenarios(rank: int, model_path: str, probe: list[list[int]], batch: list[Trajectory], out_dir: str) -> dict:
    from megatron.core import parallel_state

    out = {}
    for ep in (1, 2):
        out[ep] = ep_scenario(rank, model_path, ep, probe, batch, out_dir)
        parallel_state.destroy_model_parallel()  # the next trainer splits its own groups from the same world
    return out


def ep_scenario(rank: int, model_path: str, ep: int, probe: list[list[int]], batch: list[Trajectory],
                out_dir: str) -> dict:
    """Base logits and logprobs (also replaying `batch`'s recorded routes); STEPS fused steps of an attention-only
    task "a" and a default-target task "e" (experts included) and one step of a single row of "e", each step's
    metrics and gradients, the adapters after them; both exported (by each rank, to a directory of its own) and
    "e" loaded back."""
    from marlaas_hpc.trainer.trainer import MultiLoraTrainer, TrainerConfig

    trainer = MultiLoraTrainer(TrainerConfig(model_path=model_path, data_parallel=2, expert_parallel=ep, seed=7,
                                             dtype="float32"))
    record: dict = {"local_experts": [len(layer.mlp.experts.local_experts) for layer in trainer.model.decoder.layers
                                      if hasattr(layer.mlp, "experts")],
                    "base_logits": trainer.logits(None, probe), "base_logprobs": trainer.logprobs(None, batch),
                    "replay_logprobs": trainer.logprobs(None, batch, replay=True)}
    trainer.add_task("a", LORA, ALGO)
    trainer.add_task("e", EXPERT_LORA, ALGO)
    batches = {"a": batch, "e": [replace(traj, task_id="e", group_id="e" + traj.group_id) for traj in batch]}
    record["steps"] = []
    # then a step of one row: one DP replica has none and runs a zero-weight micro-batch (trainer/lockstep.py)
    for plan in [batches] * STEPS + [{"e": batches["e"][:1]}]:
        metrics = trainer.train_steps(plan)
        record["steps"].append({t: {"metrics": metrics[t], "grads": trainer.adapter_tensors(t, grads=True)}
                                for t in plan})
    record["tensors"] = {t: trainer.adapter_tensors(t) for t in batches}
    record["logprobs_e"] = trainer.logprobs("e", batches["e"])
    record["export"] = {t: str(trainer.export_adapter(t, Path(out_dir) / f"ep{ep}-rank{rank}-{t}")) for t in batches}
    trainer.load_adapter("e-reloaded", record["export"]["e"], ALGO)
    record["reloaded_logits"] = trainer.logits("e-reloaded", probe)
    record["logits_e"] = trainer.logits("e", probe)
    trainer.close()
    return record
