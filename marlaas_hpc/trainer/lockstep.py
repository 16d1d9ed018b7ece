"""A training step's forwards and backwards in step over an expert-parallel group (trainer/experts_parallel.py).

Every MoE layer of an expert-parallel model is a collective of its EP group, in every forward and backward: the
group's DP replicas must run the same sequence of them, while each trains its own share of the step's rows
(trainer.py `train_steps`). A replica's micro-batch runs the KL base forward when a task of its rows has a KL term,
a lagged forward per version lag its TIS / IcePop rows have, then the trained forward and backward; so with EP:
- every micro-batch runs the base forward if any row of the whole step needs it, and the lagged forward of every
  lag of the whole step (`lockstep_forwards`: every replica knows the whole step's rows, no communication);
- a micro-batch without a trained token still runs a backward (trainer.py: the loss starts at hidden.sum() x 0);
- a replica with fewer micro-batches than another of its EP group (`max_over`) runs zero-weight ones
  (`filler_micro_batch`): the same forwards on one of the step's rows with no adapter, and a backward of 0.
What the extra forwards cost: a base or lagged forward on micro-batches that need none (only at EP > 1).

Imports no megatron (trainer.py imports it before the CPU shims are in).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class EpForwards:
    """The no-grad forwards every micro-batch of the step runs on every replica of an EP group."""

    base: bool
    """The KL base forward (adapters off)."""
    lags: frozenset
    """The TIS / IcePop lagged forwards, one per version lag."""


def lockstep_forwards(trainer, items) -> EpForwards:
    """The forwards of the step's rows `items` [(task id, trajectory)] (all replicas', the same on each)."""
    lags = set()
    for task_id, traj in items:
        task = trainer.tasks[task_id]
        lag = task.version - traj.behaviour_version
        if task.algo.mismatch_correction is not None and lag > 0:
            lags.add(lag)
    return EpForwards(base=any(trainer.tasks[task_id].algo.kl_beta > 0 for task_id, _ in items),
                      lags=frozenset(lags))


def max_over(value: int, group) -> int:
    """The largest `value` over `group` (its micro-batch count)."""
    tensor = torch.tensor([value], dtype=torch.long)
    if dist.get_backend(group) == "nccl":
        tensor = tensor.cuda()
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return int(tensor.item())


def filler_micro_batch(trainer, traj, forced: EpForwards) -> None:
    """A micro-batch that changes nothing: `traj` with no adapter, the step's no-grad forwards, the trained forward
    in train mode and a backward of 0 (its all-to-alls are what the EP group's other replicas wait on)."""
    from marlaas_hpc.trainer.model import training_mode

    batch = trainer._pack([(None, traj)])
    rows = [None] * len(batch.tasks)
    mask = trainer.attention.mask(batch.prompt_of, batch.own)
    with torch.no_grad(), trainer.lora.ctx.use(rows), trainer.attention.use(mask) as argument:
        for _ in range(int(forced.base) + len(forced.lags)):
            trainer._trained_hidden(batch, argument)
    with training_mode(trainer.model), trainer.lora.ctx.use(rows), trainer.attention.use(mask) as argument:
        (trainer._trained_hidden(batch, argument).sum() * 0.0).backward()


def split_expert_params(params: list) -> tuple[list, list]:
    """(expert LoRA parameters of an EP rank, the rest): the first are summed over the expert-data-parallel group
    only (trainer/lora.py `ExpertLoraSite` marks them at EP > 1)."""
    experts = [param for param in params if getattr(param, "expert_parallel", False)]
    return experts, [param for param in params if not getattr(param, "expert_parallel", False)]


def sum_grads(params: list, group) -> None:
    """Sums the parameters' gradients over `group` in one all-reduce (nothing for a group of one)."""
    if not params or group is None or dist.get_world_size(group) == 1:
        return
    flat = torch.cat([param.grad.reshape(-1) for param in params])
    dist.all_reduce(flat, group=group)
    offset = 0
    for param in params:
        param.grad.copy_(flat[offset: offset + param.numel()].view_as(param))
        offset += param.numel()
