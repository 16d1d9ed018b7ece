"""torch.distributed groups of the job's own, made from a TCPStore rather than from the default group (on rollout
ranks vLLM owns the default group, on trainer ranks megatron does): a trainer group's world, each delta channel,
each relay link. Here: the store, the group of a backend, its set-up with a deadline, completion of a posted
collective on the host, its abort, what is kept of a group left behind, and which GPU a member has (NCCL needs a GPU
of its own per member).

NCCL and gloo differ where a member dies or never comes, and the delta plane must be safe on both:
- gloo fails a collective whose peer's socket closed (a dead member) and times a missing member out after the
  group's timeout; its `abort()` ends nothing that is pending.
- NCCL never completes a collective that waits for a dead member: the kernel spins, the work stays in torch's
  watchdog list, and the watchdog ends the process once the group's timeout passes (TORCH_NCCL_ASYNC_ERROR_HANDLING's
  default). `abort()` (ncclCommAbort) ends every pending work with an error and takes the group out of the
  watchdog. So a group that is left behind with work pending is aborted first (`abort`), always.
- A communicator's set-up (its first collective) blocks until every member joins; NCCL's blocking init cannot be
  abandoned. Delta channels are made in NCCL's non-blocking mode, their set-up polled against a deadline and the
  group aborted past it (`set_up`; torch waits for a non-blocking init for at most
  TORCH_NCCL_NONBLOCKING_TIMEOUT, which `nccl_setup_deadline` sets). Gloo meets its members in its constructor,
  under the group's own timeout (measured: a store's shorter timeout does not bound it), so a gloo group that may
  lose a member is made with the set-up deadline and given its collective timeout once up.
What NCCL does here is read from torch 2.13's ProcessGroupNCCL, not run (no GPU on the machines that test this):
tests/test_delta_faults.py checks the channel code against a stand-in group with NCCL's behaviour.
"""
from __future__ import annotations

import os
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


class SetupFailed(ConnectionError):
    """A group's set-up did not complete: a member died or never came before the deadline."""


def process_group(backend: str, store, member: int, size: int, timeout: timedelta,
                  setup_timeout: timedelta | None = None):
    """A group of `size` members over `store`. `timeout`: how long a collective may wait (NCCL's watchdog ends the
    process past it). `setup_timeout`: how long its set-up may wait for its members, and then the communicator is
    made to be abandoned if they do not all come: gloo meets them in its constructor, under the group's timeout
    (then raised to `timeout`); NCCL sets up in non-blocking mode at the first collective (`set_up`)."""
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        if setup_timeout is not None:
            options.config.blocking = 0
        return dist.ProcessGroupNCCL(store, member, size, options)
    group = dist.ProcessGroupGloo(store, member, size, setup_timeout or timeout)
    if setup_timeout is not None:
        group.set_timeout(timeout)
    return group


_LEFT_BEHIND: list = []
"""What `keep_till_exit` was given: referenced for the rest of the process's life."""


def keep_till_exit(left_behind) -> None:
    """Keeps a group left behind (or what holds one: a retired channel, relay, pusher) until the process ends. A
    rank ends by os._exit (runtime/process.py `end_rank`), which destroys nothing; a gloo group destroyed earlier,
    when its owner is let go at the end of the role's loop, joins its worker threads, and a broadcast abandoned on it
    holds one of them until the group's timeout (delta.timeout_s, 30 min by default). Measured 2026-11-29: at the end
    of every local job that had lost or gained a rollout rank, the surviving rollout ranks waited there while their
    peers spun at 100% CPU in ULFM's MPI_Finalize (its agreement needs every survivor) until its 30-s deadline ended
    them by SIGALRM (runtime/process.py `_finalize_deadline`)."""
    _LEFT_BEHIND.append(left_behind)


def nccl_setup_deadline(setup_timeout_s: float, environ=os.environ) -> None:
    """Bounds how long torch waits for a non-blocking NCCL communicator to come up (ProcessGroupNCCL reads
    TORCH_NCCL_NONBLOCKING_TIMEOUT, in seconds, when it makes one); a site's own setting is kept."""
    environ.setdefault("TORCH_NCCL_NONBLOCKING_TIMEOUT", str(max(1, int(setup_timeout_s))))


def abort(group) -> None:
    """Ends `group` so that nothing of it can hold the process: on NCCL every pending collective ends with an
    error and the watchdog lets go of it; on gloo nothing pending ends (a dead peer already failed it, a missing
    one times out), and the group is only marked. Never raises: a group is aborted because it is being left."""
    try:
        group.abort()
    except Exception:  # an abort that fails leaves nothing more to do
        pass


def set_up(group, device: torch.device, deadline_s: float, idle_sleep: float = 0.001) -> None:
    """The group's first collective (a one-element broadcast from member 0), which sets up an NCCL communicator,
    polled until `deadline_s`; past it, or if it fails, the group is aborted and SetupFailed raised."""
    deadline = time.monotonic() + deadline_s
    try:
        work = group.broadcast(torch.zeros(1, device=device), 0)
        while not work.is_completed():
            if time.monotonic() > deadline:
                raise TimeoutError(f"not set up after {deadline_s:.0f} s")
            time.sleep(idle_sleep)
        work.wait()
    except Exception as exc:
        abort(group)
        raise SetupFailed(f"{type(exc).__name__}: {exc}") from exc


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
