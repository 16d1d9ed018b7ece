"""One trainer run per TP size, executed in spawned gloo processes; the trainer tests compare its records.

A single scenario per TP size keeps the (slow: ~10 s) megatron import + model build to one per process.
Rank 0 returns the full record; every rank returns its own isolation checks.
"""
from __future__ import annotations

import random
from pathlib import Path

import torch

from marlaas_hpc.tasks.spec import AlgoSpec, LoraSpec
from marlaas_hpc.trajectory import Trajectory

# task id -> (LoRA shape, GRPO settings). b and c target strict subsets of the fused q/k/v and gate/up sites.
TASKS = {
    "a": (LoraSpec(rank=4, alpha=8.0), AlgoSpec(lr=5e-3, kl_beta=0.05)),
    "b": (LoraSpec(rank=2, alpha=4.0, target_modules=("q_proj", "v_proj")), AlgoSpec(lr=5e-3, temperature=0.7)),
    "c": (LoraSpec(rank=3, alpha=3.0, target_modules=("k_proj", "up_proj", "down_proj")), AlgoSpec(lr=5e-3)),
}
FUSED_STEPS = 3
PROBE_IDS = [[5, 9, 17, 33, 65, 100, 101, 7, 8, 44], [12, 13, 14, 15, 16, 90, 91, 92, 93, 94]]


def make_trajectories(task_id: str, seed: int, n: int = 8) -> list[Trajectory]:
    """Random token sequences (behaviour logprobs filled in later from the HF base model)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(3, 128) for _ in range(rng.randrange(3, 9))]
        completion = [rng.randrange(3, 128) for _ in range(rng.randrange(2, 9))]
        mask = None
        if i % 3 == 2:  # a multi-turn episode: a tool observation in the middle is not trained
            mask = [1] * len(completion)
            mask[len(completion) // 2] = 0
        out.append(Trajectory(task_id=task_id, group_id=f"{task_id}-g{i // 4}", prompt_ids=prompt,
                              completion_ids=completion, behaviour_logprobs=[0.0] * len(completion),
                              behaviour_version=0, reward=float(rng.random() < 0.5), loss_mask=mask))
    return out


def _params_equal(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> bool:
    return before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def _optimizer_tensors(trainer, task_id: str) -> dict[str, torch.Tensor]:
    state = trainer.tasks[task_id].optimizer.state_dict()["state"]
    return {f"{i}.{k}": v.clone() for i, s in state.items() for k, v in s.items() if torch.is_tensor(v)}


def run_scenario(rank: int, model_path: str, tp: int, batches: dict[str, list[Trajectory]], out_dir: str,
                 micro_batch_size: int) -> dict:
    import time

    start = time.perf_counter()
    from marlaas_hpc.trainer.cpu_shims import apply_cpu_shims
    from marlaas_hpc.trainer.trainer import MultiLoraTrainer, TrainerConfig

    imported = time.perf_counter()
    trainer = MultiLoraTrainer(TrainerConfig(model_path=model_path, tensor_parallel=tp, seed=7,
                                             micro_batch_size=micro_batch_size))
    record: dict = {"shims_idempotent": apply_cpu_shims() and apply_cpu_shims()}
    built = time.perf_counter()
    base_before = {k: v.detach().clone() for k, v in trainer.model.state_dict().items() if torch.is_tensor(v)}
    record["base_logits"] = trainer.logits(None, PROBE_IDS)
    for task_id, (lora, algo) in TASKS.items():
        trainer.add_task(task_id, lora, algo)
    record["init_tensors"] = {t: trainer.adapter_tensors(t) for t in TASKS}

    # isolation: training a alone leaves b and c (weights, optimizer state) bit-identical
    others_before = {t: trainer.lora.local_state_dict(t) for t in ("b", "c")}
    record["isolation_metrics"] = trainer.train_step("a", batches["a"])
    record["others_untouched"] = all(_params_equal(others_before[t], trainer.lora.local_state_dict(t))
                                     for t in others_before)
    record["others_no_grad"] = all(p.grad is None for t in ("b", "c") for p in trainer.lora.parameters(t))

    record["steps"] = []
    for _ in range(FUSED_STEPS):
        metrics = trainer.train_steps(batches)
        grads = {t: trainer.adapter_tensors(t, grads=True) for t in TASKS}
        record["steps"].append({"metrics": metrics, "grads": grads})
    record["tensors"] = {t: trainer.adapter_tensors(t) for t in TASKS}
    record["versions"] = {t: trainer.version(t) for t in TASKS}

    # b only: a and c untouched, including Adam moments
    snapshot = {t: (trainer.lora.local_state_dict(t), _optimizer_tensors(trainer, t)) for t in ("a", "c")}
    trainer.train_step("b", batches["b"])
    record["isolation_b"] = all(_params_equal(snapshot[t][0], trainer.lora.local_state_dict(t))
                                and _params_equal(snapshot[t][1], _optimizer_tensors(trainer, t))
                                for t in snapshot)
    base_after = {k: v.detach() for k, v in trainer.model.state_dict().items() if torch.is_tensor(v)}
    record["base_untouched"] = _params_equal(base_before, base_after)

    record["logits"] = {t: trainer.logits(t, PROBE_IDS) for t in TASKS}
    record["mixed_logits"] = trainer.logits(["a", None], PROBE_IDS)
    record["logprobs"] = {t: trainer.logprobs(t, batches[t][:3], TASKS[t][1].temperature) for t in TASKS}
    record["exports"] = {t: str(trainer.export_adapter(t, Path(out_dir) / f"tp{tp}" / t)) for t in TASKS}

    # resume: a state_dict round trip reproduces the next step exactly
    saved = trainer.state_dict("a")
    first = trainer.train_step("a", batches["a"])
    after_first = trainer.lora.local_state_dict("a")
    trainer.load_state_dict("a", saved)
    second = trainer.train_step("a", batches["a"])
    record["resume_same_loss"] = first["loss"] == second["loss"] and first["version"] == second["version"]
    record["resume_same_weights"] = _params_equal(after_first, trainer.lora.local_state_dict("a"))

    # import: the exported c loaded as a new task gives c's logits
    trainer.load_adapter("c2", record["exports"]["c"], algo=TASKS["c"][1], version=trainer.version("c"))
    record["imported_logits_diff"] = float((trainer.logits("c2", PROBE_IDS) - record["logits"]["c"]).abs().max())
    trainer.remove_task("c2")
    record["task_ids"] = trainer.task_ids()
    trainer.close()
    record["seconds"] = {"import": imported - start, "build": built - imported, "run": time.perf_counter() - built}
    return record
