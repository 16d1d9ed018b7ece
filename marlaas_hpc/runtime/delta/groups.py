"""torch.distributed groups of the job's own, made from a TCPStore rather than from the default group (on rollout
ranks vLLM owns the default group, on trainer ranks megatron does): a trainer group's world, each delta channel,
each relay link. Here: the store, the group of a backend, completion of a posted collective on the host, and which
GPU a member has (NCCL needs a GPU of its own per member)."""
from __future__ import annotations

import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def gpu_key(device: torch.device) -> str | None:
    """Identifies the physical GPU behind `device` across the job (host + UUID; indices repeat between
    ranks once each sees only its own GPUs); None for a CPU device."""
    if device.type != "cuda":
        return None
    return f"{socket.gethostname()}/{torch.cuda.get_device_properties(device).uuid}"


def process_group(backend: str, store, member: int, size: int, timeout: timedelta):
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, member, size, options)
    return dist.ProcessGroupGloo(store, member, size, timeout)


def host_store(size: int, host: str | None = None, timeout_s: float = 600.0) -> tuple[dist.TCPStore, tuple]:
    """The master side of a TCPStore for `size` members, on a port the kernel picks as it binds (port 0), and
    the (host, port) the other members connect to. Probing a free port and binding it later left a window in
    which another process of the job (a second trainer group, a delta channel) took it: EADDRINUSE at start."""
    store = dist.TCPStore(host or socket.gethostname(), 0, size, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout_s))
    return store, (host or socket.gethostname(), store.port)


def join_store(address: tuple, size: int, timeout_s: float = 600.0) -> dist.TCPStore:
    """A member's client of the store that `host_store` made at `address`."""
    return dist.TCPStore(address[0], address[1], size, is_master=False, timeout=timedelta(seconds=timeout_s))


def complete(work, idle_sleep: float = 0.0002) -> None:
    """Waits on the host until a posted collective is done, then raises what it failed with. torch's NCCL
    `work.wait()` (no blocking-wait mode, no timeout given) only makes the current CUDA stream wait for the
    collective's stream and returns at once; `is_completed()` reads the collective's end event without blocking.
    So poll that, sleeping between reads (a spinning rank takes a core from its neighbours), then `wait()`,
    which no longer waits for anything. Gloo's wait() blocks on the host anyway: the same loop serves both."""
    while not work.is_completed():
        time.sleep(idle_sleep)
    work.wait()
