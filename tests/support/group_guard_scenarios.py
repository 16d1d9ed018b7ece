"""A TP=2 trainer group whose steps fail on one rank, or on both alike, under runtime/group_guard.py; run in two
spawned gloo processes by tests/test_group_guard.py (tests/support/local_group.py).

`faults_scenario` trains tasks a and b (tests/trainer_scenarios.py) for STEPS fused steps twice from the same
initial adapters: once with no fault (the reference), once with the faults of FAULTS injected, each step under a
GroupGuard. Faults are raised by patches of this process only (`inject`):
- 'forward': one rank raises CUDA's out-of-memory error inside the LoRA hook of a mid-forward site, between two
  TP collectives (its peer is then blocked in the next one);
- 'grad_norm': one rank raises it in task b's gradient norm, after task a's optimizer step (a's state changed,
  b's collective pending on the peer);
- 'task': both ranks raise the same ValueError at the same hook (a task's fault).
"""
from __future__ import annotations

import time

import torch

from support.trainer_scenarios import TASKS, make_trajectories

STEPS = 4
STEP_TASKS = ("a", "b")
FAULTS = {1: ("forward", 1), 2: ("grad_norm", 0), 3: ("task", None)}
"""step index (0-based) of the fault run -> (what, the one rank that raises; None: both)."""
FORWARD_HOOK = 5
"""The LoRA hook call of the forward at which 'forward' and 'task' raise (the tiny model: a mid layer's site)."""


class Injected:
    """Which fault the patches raise now (None: none)."""

    what: str | None = None
    hooks = 0


def inject(rank: int) -> None:
    """Patches LoraSite._hook and MultiLora.grad_norm to raise the fault `Injected.what` names on this rank."""
    from marlaas_hpc.trainer import lora

    hook, grad_norm = lora.LoraSite._hook, lora.MultiLora.grad_norm

    def faulty_hook(self, module, args, kwargs, output):
        if Injected.what in ("forward", "task") and self.adapters and self.ctx.rows is not None:
            Injected.hooks += 1
            if Injected.hooks == FORWARD_HOOK:
                what, Injected.what = Injected.what, None
                if what == "task":
                    raise ValueError("injected: this batch cannot be trained")
                raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate 2.00 GiB (injected on rank "
                                             f"{rank})")
        return hook(self, module, args, kwargs, output)

    def faulty_grad_norm(self, name):
        if Injected.what == "grad_norm" and name == "b":
            Injected.what = None
            raise torch.OutOfMemoryError(f"CUDA out of memory (injected on rank {rank}, in b's grad norm)")
        return grad_norm(self, name)

    lora.LoraSite._hook, lora.MultiLora.grad_norm = faulty_hook, faulty_grad_norm


def _fresh_tasks(trainer) -> None:
    for task_id in list(trainer.tasks):
        trainer.remove_task(task_id)
    for task_id in STEP_TASKS:
        lora, algo = TASKS[task_id]
        trainer.add_task(task_id, lora, algo)


def faults_scenario(rank: int, model_path: str) -> dict:
    from marlaas_hpc.runtime.group_guard import GroupGuard, TaskFault
    from marlaas_hpc.trainer.trainer import MultiLoraTrainer, TrainerConfig
    from marlaas_hpc.trajectory import assign_advantages

    inject(rank)  # before the trainer: its LoRA sites register their hooks as bound methods
    trainer = MultiLoraTrainer(TrainerConfig(model_path=model_path, tensor_parallel=2, seed=7))
    batches = {t: make_trajectories(t, seed=200 + i) for i, t in enumerate(STEP_TASKS)}
    for trajs in batches.values():
        assign_advantages(trajs)
    record: dict = {"reference": [], "faulted": [], "raised": {}}
    _fresh_tasks(trainer)
    for _ in range(STEPS):
        record["reference"].append(trainer.train_steps(batches))
    record["reference_tensors"] = {t: trainer.adapter_tensors(t) for t in STEP_TASKS}

    _fresh_tasks(trainer)
    guard = GroupGuard(trainer, watch=False)
    for step in range(STEPS):
        what, who = FAULTS.get(step, (None, None))
        before = {t: trainer.lora.local_state_dict(t) for t in STEP_TASKS}
        Injected.what, Injected.hooks = (what if who in (None, rank) else None), 0
        start = time.monotonic()
        try:
            metrics = guard.run("train", lambda: trainer.train_steps(batches), STEP_TASKS)
        except TaskFault as fault:
            record["raised"][step] = {"stage": fault.stage, "reason": fault.reason,
                                      "restored": all(torch.equal(before[t][k], v) for t in STEP_TASKS
                                                      for k, v in trainer.lora.local_state_dict(t).items()),
                                      "versions": {t: trainer.version(t) for t in STEP_TASKS}}
            metrics = guard.run("train", lambda: trainer.train_steps(batches), STEP_TASKS)  # the groups work again
        record["faulted"].append({"metrics": metrics, "seconds": time.monotonic() - start})
    record["faulted_tensors"] = {t: trainer.adapter_tensors(t) for t in STEP_TASKS}
    record["versions"] = {t: trainer.version(t) for t in STEP_TASKS}
    record["regroups"] = guard.regroups
    record["group_epoch"] = trainer.group_epoch
    trainer.close()
    return record


class _NcclLikeTrainer:
    """What GroupGuard uses of a trainer, with NCCL's behaviour towards a peer that left a collective: this rank's
    pending collective (`collective`) ends only when this rank aborts its own groups (`abort_all`, the guard's
    watcher) or takes them down; gloo would have failed it when the peer closed its sockets."""

    backend = "nccl"

    def __init__(self, rank: int):
        import threading

        import torch.distributed as dist

        from marlaas_hpc.trainer import process_groups

        self.group_rank, self.group_size = rank, 2
        self.group_store = dist.distributed_c10d._get_default_store()
        self.control_group = process_groups.control_group(self.group_store, rank, 2)
        self.aborted = threading.Event()
        self.events: list[str] = []
        process_groups.abort_all = self.abort  # what the watcher calls

    def abort(self) -> None:
        self.events.append("aborted by the watcher")
        self.aborted.set()

    def collective(self, wait_s: float) -> str:
        if not self.aborted.wait(wait_s):
            return "still pending"
        raise RuntimeError("aborted")  # not a marker faults.is_peer_lost knows: the watcher makes it PEER

    def snapshot(self, task_ids):
        return {}

    def restore(self, snapshot) -> None:
        self.events.append("restored")

    def take_down_groups(self) -> list[str]:
        self.events.append("taken down")
        self.aborted.set()
        return []

    def remake_groups(self) -> None:
        self.events.append("made again")
        self.aborted.clear()


def nccl_watch_scenario(rank: int, watch: bool) -> dict:
    """Rank 1 runs out of memory while rank 0 waits in a collective it will never complete (NCCL's behaviour):
    with the watcher, rank 0's collective ends at rank 1's alarm and the section runs again on both."""
    from marlaas_hpc.runtime.group_guard import GroupGuard

    trainer = _NcclLikeTrainer(rank)
    guard = GroupGuard(trainer, watch=watch)
    attempts = []

    def section():
        attempts.append(time.monotonic())
        if len(attempts) == 1 and rank == 1:
            time.sleep(0.5)
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        if len(attempts) == 1:
            return trainer.collective(wait_s=15.0)
        return "done"

    start = time.monotonic()
    result = guard.run("train", section)
    return {"result": result, "attempts": len(attempts), "seconds": time.monotonic() - start,
            "events": trainer.events, "regroups": guard.regroups}
