"""The trainer's process groups taken down and made again in place, while the process and the model stay
(runtime/group_guard.py: a trainer group whose step failed on some of its ranks).

A trainer's collectives run on the default torch.distributed group (the trainer group's TP x DP ranks) and on the
groups megatron's parallel state splits from it (TP, DP, and the model/embedding/... groups megatron makes); many
objects hold them: every megatron linear and attention (`tp_group`, `pg_collection`), the LoRA sites, the LM
head, the trainer itself. Once a rank of the group has left a collective sequence midway, those groups can no
longer be trusted (a peer has issued collectives this rank never will), so they are replaced as a whole.

`take_down` ends them on this rank: every group is aborted (NCCL: each pending collective ends with an error and
leaves torch's watchdog), every reference to it in `roots` is replaced by a `TakenDown` marker, megatron's
parallel state and torch's group registry forget them, and the last references go. On gloo that last step is
what frees peers: `abort()` ends nothing there, but a destroyed gloo group closes its sockets, and a peer's
collective pending on it raises "Connection closed by peer" at once (measured, torch 2.13). A reference left
anywhere keeps the sockets open, so `take_down` reports the groups that outlived it.

`remake` makes them again from the trainer group's store under a fresh prefix (the first incarnation's
rendezvous keys are still there): a new default group, megatron's groups split from it, and every `TakenDown`
marker in `roots` replaced by the new group of the same name."""
from __future__ import annotations

import gc
import itertools
import weakref
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

WORLD = "WORLD"
"""The name of the default group (megatron's groups are named by their parallel_state global)."""


@dataclass(frozen=True)
class TakenDown:
    """Stands where a taken-down process group was referenced, until `remake` puts its successor there."""

    name: str | None
    """Its parallel_state global (or WORLD); None: a group neither made, which `remake` cannot replace."""

    def __getattr__(self, attribute):
        raise RuntimeError(f"process group {self.name} was taken down after a failed step and not made again")


CONTROL_SETUP_TIMEOUT = timedelta(minutes=10)
CONTROL_TIMEOUT = timedelta(hours=3)
"""How long a vote on the control group waits for the slowest rank's section (a long step, the leader's
publication of its versions)."""


_prefixes = itertools.count()
"""Store prefixes of this process's control groups and remade groups: every rank of a trainer group makes them in the
same order (a test may build several trainers over one store), and a prefix used once keeps its rendezvous keys."""


def control_group(store, rank: int, size: int):
    """The trainer group's control group: gloo over `store` under a prefix of its own, outside torch's registry (no
    `take_down` reaches it). Made by every rank of the trainer group as its trainer is built."""
    if size == 1:
        return None
    group = dist.ProcessGroupGloo(dist.PrefixStore(f"control{next(_prefixes)}/", store), rank, size,
                                  CONTROL_SETUP_TIMEOUT)
    group.set_timeout(CONTROL_TIMEOUT)
    return group


def named_groups() -> dict[str, dist.ProcessGroup]:
    """This process's trainer groups by name: the default group (WORLD) and megatron's parallel_state globals."""
    from megatron.core import parallel_state

    groups = {}
    if dist.is_initialized():
        groups[WORLD] = dist.group.WORLD
    for name, value in vars(parallel_state).items():
        if isinstance(value, dist.ProcessGroup):
            groups[name] = value
    return groups


def abort_all() -> None:
    """Aborts every group of this process's torch.distributed registry (NCCL: pending collectives end with an
    error; gloo: nothing ends). Never raises: a group is aborted because it is being left. Safe from another
    thread (runtime/group_guard.py's watcher)."""
    from torch.distributed.distributed_c10d import _world

    for group in list(_world.pg_map):
        try:
            group.abort()
        except Exception:
            pass


def _holders(roots):
    """(object, attribute, value) for every attribute of `roots`, and of the plain objects they hold (megatron's
    `pg_collection`, the LM head, ...), that is a process group or a TakenDown marker."""
    seen: set[int] = set()

    def visit(obj, depth: int):
        if id(obj) in seen:
            return
        seen.add(id(obj))
        for attribute, value in list(vars(obj).items()):
            if isinstance(value, (dist.ProcessGroup, TakenDown)):
                yield obj, attribute, value
            elif depth < 1 and hasattr(value, "__dict__") and not isinstance(
                    value, (torch.nn.Module, torch.Tensor, type)) and not callable(value):
                yield from visit(value, depth + 1)

    for root in roots:
        yield from visit(root, 0)


def take_down(roots) -> list[str]:
    """Ends every trainer group on this rank (module doc). Returns the names of groups something outside `roots`
    still references (on gloo their peers stay blocked until the group's timeout): [] when all are gone."""
    from megatron.core import parallel_state

    alive = _unhook(roots)
    parallel_state.destroy_model_parallel()
    for name, value in list(vars(parallel_state).items()):
        if isinstance(value, dist.ProcessGroup):  # a few globals destroy_model_parallel leaves set (mcore 0.16)
            setattr(parallel_state, name, None)
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()  # frames of the failed step (tracebacks, autograd graphs) may sit in reference cycles
    return sorted(str(name) for name, ref in alive.values() if ref() is not None)


def _unhook(roots) -> dict:
    """Aborts every group and puts a TakenDown marker in its place in `roots`; {id: (name, weak reference)} of each
    group (a function of its own: no local of it outlives the call)."""
    alive = {id(group): (name, weakref.ref(group)) for name, group in named_groups().items()}
    names = {key: name for key, (name, _) in alive.items()}
    abort_all()
    for obj, attribute, group in list(_holders(roots)):
        if isinstance(group, dist.ProcessGroup):
            alive.setdefault(id(group), (names.get(id(group)), weakref.ref(group)))
            setattr(obj, attribute, TakenDown(names.get(id(group))))
    _swap_defaults(lambda group: TakenDown(names.get(id(group))) if isinstance(group, dist.ProcessGroup) else group)
    return alive


DEFAULT_HOLDERS = ("torch.distributed.nn.functional",)
"""Modules whose functions take `group=group.WORLD` as a default argument, evaluated when they were imported (megatron
imports them through torch.distributed.fsdp): each holds the first default group until its defaults change."""


def _swap_defaults(replace) -> None:
    """Each default argument of DEFAULT_HOLDERS' functions replaced by `replace(value)`."""
    import sys

    for module_name in DEFAULT_HOLDERS:
        module = sys.modules.get(module_name)
        for function in list(vars(module).values()) if module is not None else ():
            defaults = getattr(function, "__defaults__", None)
            if defaults and any(isinstance(value, (dist.ProcessGroup, TakenDown)) for value in defaults):
                function.__defaults__ = tuple(replace(value) for value in defaults)


def remake(roots, store, backend: str, rank: int, size: int, tensor_parallel: int,
           timeout: timedelta | None = None, expert_parallel: int = 1) -> None:
    """The default group again from `store` under a fresh prefix, megatron's groups split from it, and each
    TakenDown marker in `roots` replaced by the new group of its name (collective over the trainer group's ranks)."""
    from megatron.core import parallel_state

    prefix = f"regroup{next(_prefixes)}/"
    dist.init_process_group(backend, store=dist.PrefixStore(prefix, store), rank=rank, world_size=size,
                            **({"timeout": timeout} if timeout is not None else {}))
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel,
                                             expert_model_parallel_size=expert_parallel,
                                             create_gloo_process_groups=False)
    groups = named_groups()
    _swap_defaults(lambda value: groups.get(value.name, value) if isinstance(value, TakenDown) else value)
    for obj, attribute, marker in list(_holders(roots)):
        if isinstance(marker, TakenDown):
            if marker.name not in groups:
                raise RuntimeError(f"{type(obj).__name__}.{attribute} held a process group that cannot be made again "
                                   f"({marker.name})")
            setattr(obj, attribute, groups[marker.name])
