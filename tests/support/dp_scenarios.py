"""One trainer run per (TP, DP) shape, in spawned gloo processes; tests/test_trainer_dp.py compares them.

Every rank builds the same batches (behaviour logprobs = the base model's at the task's temperature + seeded
noise, so ratios sit near 1 and the clip acts on a few tokens), then trains three fused steps: two over every
task's whole batch and one where task b has a single row (it lands on one DP replica only). Every rank returns
its record (metrics, full gradients and weights after each step), so replicas can be compared too.
"""
from __future__ import annotations

import random

from support.trainer_scenarios import TASKS, make_trajectories


def build_batches(trainer) -> dict:
    from marlaas_hpc.trajectory import assign_advantages

    batches = {}
    for index, (task_id, (_, algo)) in enumerate(TASKS.items()):
        trajs = make_trajectories(task_id, seed=100 + index)
        noise = random.Random(index)
        for traj, logprobs in zip(trajs, trainer.logprobs(None, trajs, algo.temperature)):
            traj.behaviour_logprobs = [v + noise.gauss(0.0, 0.1) if m else 0.0
                                       for v, m in zip(logprobs, traj.mask())]
        assign_advantages(trajs)
        batches[task_id] = trajs
    return batches


def run_dp_scenario(rank: int, model_path: str, tp: int, dp: int, micro_batch_tokens: int) -> dict:
    from marlaas_hpc.trainer.trainer import MultiLoraTrainer, TrainerConfig

    trainer = MultiLoraTrainer(TrainerConfig(model_path=model_path, tensor_parallel=tp, data_parallel=dp, seed=7,
                                             micro_batch_tokens=micro_batch_tokens))
    for task_id, (lora, algo) in TASKS.items():
        trainer.add_task(task_id, lora, algo)
    batches = build_batches(trainer)
    plans = [batches, batches, {"a": batches["a"], "b": batches["b"][:1]}]
    steps = []
    for plan in plans:
        metrics = trainer.train_steps(plan)
        steps.append({"metrics": metrics, "grads": {t: trainer.adapter_tensors(t, grads=True) for t in plan},
                      "tensors": {t: trainer.adapter_tensors(t) for t in TASKS}})
    record = {"steps": steps, "tp_rank": trainer.tp_rank, "dp_rank": trainer.dp_rank, "dp_size": trainer.dp_size,
              "versions": {t: trainer.version(t) for t in TASKS}}
    trainer.close()
    return record
