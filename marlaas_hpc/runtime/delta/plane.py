"""The delta plane's one interface: how each new adapter version goes from the trainer leader that owns its task to
every rollout rank. One transport per module, chosen by `delta.transport` (runtime/delta/__init__.py
`delta_plane`):

    broadcast (broadcast.py)    leader ──DeltaAnnounce (MPI) + one flat broadcast──► every rollout rank
    relay (relay_plane.py)      leader ──push──► relay ──► relay ──► ...  each rollout rank reads its own relay

    DeltaPlane (per job)   every rank calls its role's method once, at the same point of its start-up (for some
                           transports a collective over the world: the order is part of the protocol)
    DeltaSender (leader)   send a version without waiting for rollout ranks; remake when the rollout ranks change
    DeltaReceiver (rollout rank)   poll between engine steps for versions to install

What a version is on the wire, whatever the transport: a `DeltaAnnounce` (names, shapes, LoraSpec) and one flat
float32 buffer of its tensors in the announce's order (`flat_buffer` / `unflatten`).

No torch at import (only in the two functions that move tensors): rank 0 and the env ranks hold the plane and
start without torch (runtime/delta/broadcast_plane.py).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Callable, Iterator

from marlaas_hpc.runtime.messages import DeltaAnnounce

if TYPE_CHECKING:
    import torch

Received = Iterator[tuple[DeltaAnnounce, Callable[[], dict[str, "torch.Tensor"]]]]
"""(announce, receive) per version to install; `receive()` returns its tensors."""


class DeltaSender(ABC):
    """A trainer leader's end: `send` returns without waiting for any rollout rank; `flush`/`close` wait."""

    epoch = 0
    """The rollout ranks' epoch it serves (rank 0's `delta_epoch` when it was last remade)."""
    sent = 0
    """Versions sent."""
    blocked_s = 0.0
    """Seconds spent inside `send` (the leader's blocked time per update)."""
    flush_s = 0.0
    """Seconds spent inside `flush`/`close` (at the end)."""
    broken: str | None = None
    """Why the transport could not be set up for `epoch` after a `remake` (None: it is up). Until the next epoch
    nothing is sent; the leader asks rank 0 for one (runtime/trainer_rank.py: DeltaPlaneFailed)."""

    @abstractmethod
    def send(self, task_id: str, version: int, tensors: dict[str, torch.Tensor], lora) -> None:
        """Posts `version` of the task's adapter (published under `task_id`) to every rollout rank."""

    @abstractmethod
    def flush(self) -> None:
        """Waits until every posted version has left this rank."""

    @abstractmethod
    def close(self) -> None:
        """Before the rank leaves: flush, and end what the transport holds open."""

    @abstractmethod
    def remake(self, rollout_ranks: list[int], epoch: int) -> None:
        """The rollout ranks changed (one lost, joined or drained): serve `rollout_ranks` from now on. What was in
        flight may be lost; the caller sends every task's newest version again."""

    def stats(self) -> dict:
        """summary.json `trainer_groups.<g>.delta`."""
        return {"sent": self.sent, "blocked_s": self.blocked_s, "flush_s": self.flush_s}


class DeltaReceiver(ABC):
    """A rollout rank's end: polled between engine steps."""

    pins_versions = False
    """Whether it keeps a version for an open group until `unpin` (relay: pinned at the rank's relay)."""
    clock = None
    """The rank's BusyClock (set by runtime/rollout_rank.py): spans of the transport's own work."""
    leaders: list[int]
    """The trainer leaders it receives from."""

    @abstractmethod
    def poll(self) -> Received:
        """The versions ready to install, oldest first per leader."""

    @abstractmethod
    def busy(self) -> bool:
        """Versions announced and not handed out yet."""

    @abstractmethod
    def close(self) -> None:
        """At the end of the rank's loop."""

    @abstractmethod
    def drop_leader(self, leader: int) -> None:
        """A trainer leader is lost: nothing more comes from it."""

    def pin(self, task_id: str, version: int) -> bool:
        """Keeps `version` until `unpin` (a group sampling with it); False when not kept."""
        return False

    def unpin(self, task_id: str, version: int) -> None:
        """Releases one pin (only what `pin` kept)."""

    def holds(self, task_id: str, version: int) -> bool:
        """Whether the transport still holds `version`."""
        return False


class DeltaPlane(ABC):
    """The job's transport: each rank calls its role's method once, at the same point of its start-up."""

    def __init__(self, settings, rollout_ranks: list[int], leaders: list[int]):
        self.settings = settings
        """config.DeltaSettings."""
        self.rollout_ranks, self.leaders = list(rollout_ranks), list(leaders)

    @abstractmethod
    def for_scheduler(self, comm):
        """Rank 0's part (what it hosts for the transport), or None."""

    @abstractmethod
    def for_bystander(self, comm) -> None:
        """Env ranks and trainer followers: their part of a collective set-up, if any."""

    @abstractmethod
    def for_leader(self, comm, device: str, model: str | None) -> DeltaSender:
        """A trainer group's leader (`model`: its base model, named in every announce)."""

    @abstractmethod
    def for_rollout(self, comm, device: str) -> DeltaReceiver:
        """A rollout rank of the job's start."""

    @abstractmethod
    def for_joiner(self, comm, rank: int, leaders: list[int], device: str) -> DeltaReceiver:
        """A rollout rank that joined the live job: its end comes with the next remade channels (or tier)."""


def flat_buffer(tensors: dict[str, torch.Tensor], names: list[str], device: torch.device) -> torch.Tensor:
    """One float32 buffer of `tensors` in `names` order, on the channel's device: what a delta broadcast sends
    (`unflatten` is its inverse). The GPU dry run (marlaas_hpc/plan/dry_run.py) counts it."""
    import torch

    return torch.cat([tensors[n].detach().reshape(-1).float() for n in names]).to(device)


def unflatten(announce: DeltaAnnounce, flat: torch.Tensor) -> dict[str, torch.Tensor]:
    """The named tensors of one broadcast buffer (the layout DeltaChannel.send flattens them in)."""
    import torch

    flat = flat.cpu()
    out, offset = {}, 0
    for name, shape in zip(announce.names, announce.shapes):
        n = int(torch.Size(shape).numel())
        out[name] = flat[offset: offset + n].view(shape).clone()
        offset += n
    return out
