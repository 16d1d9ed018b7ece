"""Fault injection into the trainer ranks of a `marlaas run` job, for tests/test_trainer_group_faults.py only.

This directory goes on the job's PYTHONPATH, so every process of the job imports this file at start (Python's
`sitecustomize`). With MARLAAS_TEST_TRAINER_FAULTS set (a JSON list of rules) it patches, as
marlaas_hpc.trainer.trainer is imported (before any trainer exists: LoRA sites register their hooks as bound
methods), `MultiLoraTrainer.train_steps` and `LoraSite._hook`, so that a rule's error is raised inside a LoRA
hook of the forward (the HOOK-th with adapters), between two TP collectives of the fused step. Rules:

    {"position": P, "call": N, "error": "oom"}   the trainer rank at position P of its group (its rank in the
                                                  trainer world), in its N-th train step call (a redone step is
                                                  another call): CUDA's out-of-memory error
    {"position": "all", "task": T, "from_version": V, "error": "task"}
                                                  every trainer rank, in a step of task T from version V or later
                                                  fused with another task, and in every step of T from that
                                                  version on: a ValueError (the task's own, deterministic fault)
"""
import importlib.abc
import importlib.util
import json
import os
import sys

RULES = json.loads(os.environ.get("MARLAAS_TEST_TRAINER_FAULTS", "[]"))
HOOK = 5
TARGET = "marlaas_hpc.trainer.trainer"


class _State:
    calls = 0
    armed = None
    """The error the current step raises at its HOOK-th hook (None: none)."""
    hooks = 0
    task_version = None
    """The version of the task fault's task at which it was first raised (then every step from it raises)."""


def _arm(trainer, batches) -> None:
    import torch.distributed as dist

    _State.calls += 1
    _State.armed, _State.hooks = None, 0
    position = dist.get_rank()
    for rule in RULES:
        if rule["error"] == "oom" and rule["position"] == position and rule["call"] == _State.calls:
            _State.armed = "oom"
        if rule["error"] == "task" and rule["task"] in batches:
            version = trainer.version(rule["task"])
            first = _State.task_version is None and version >= rule["from_version"] and len(batches) > 1
            if first or (_State.task_version is not None and version == _State.task_version):
                _State.task_version = version
                _State.armed = "task"
    if _State.armed:
        sys.stderr.write(f"[inject] trainer position {position}: {_State.armed} in its step call {_State.calls} "
                         f"({sorted(batches)})\n")


def _patch(module) -> None:
    import torch

    from marlaas_hpc.trainer import lora

    train_steps, hook = module.MultiLoraTrainer.train_steps, lora.LoraSite._hook

    def faulty_train_steps(self, batches):
        _arm(self, batches)
        try:
            return train_steps(self, batches)
        finally:
            _State.armed = None

    def faulty_hook(self, site_module, args, kwargs, output):
        if _State.armed and self.adapters:
            _State.hooks += 1
            if _State.hooks == HOOK:
                armed, _State.armed = _State.armed, None
                if armed == "task":
                    raise ValueError("injected: this task's step cannot be trained")
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
        return hook(self, site_module, args, kwargs, output)

    module.MultiLoraTrainer.train_steps, lora.LoraSite._hook = faulty_train_steps, faulty_hook


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _patch(module)

        spec.loader.exec_module = exec_module
        return spec


if RULES:
    sys.meta_path.insert(0, _Finder())
