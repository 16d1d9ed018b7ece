"""A stand-in for an NCCL process group where a member dies or never comes, for the CPU (no test machine here has
two GPUs). It wraps a real gloo group, so data still travels between the processes, and changes only what NCCL
does differently (torch 2.13's ProcessGroupNCCL, read, not run):

- a collective that waits for a member that died or never joined never completes: gloo would fail it (a closed
  socket) or time it out; NCCL's kernel spins, so `is_completed()` stays False;
- `abort()` (ncclCommAbort) ends every pending collective with an error: `is_completed()` turns True and `wait()`
  raises, and the watchdog lets go of them;
- the watchdog (TORCH_NCCL_ASYNC_ERROR_HANDLING's default) ends the process when a collective has been pending
  for longer than the group's timeout: here `os._exit(WATCHDOG_EXIT)` after `watchdog_s`.

`patch_delta_groups(watchdog_s)` makes every delta channel of this process use it (the channel's group factory is
its seam: marlaas_hpc/runtime/delta/broadcast.py `process_group`).
"""
from __future__ import annotations

import os
import sys
import threading
import time
import weakref
from datetime import timedelta

WATCHDOG_EXIT = 6
"""The exit status of a process the stand-in's watchdog ended (SIGABRT's number, as torch's watchdog aborts)."""

_groups: "weakref.WeakSet[NcclLikeGroup]" = weakref.WeakSet()
_watchdog_started = threading.Event()


class NcclLikeWork:
    def __init__(self, inner, group: "NcclLikeGroup"):
        self.inner, self.group, self.posted = inner, group, time.monotonic()
        self.failed = False
        """gloo failed it (a dead peer): NCCL would still be waiting."""

    def _inner_done(self) -> bool:
        if self.failed or not self.inner.is_completed():
            return False
        try:
            self.inner.wait()
        except Exception:
            self.failed = True
            return False
        return True

    def is_completed(self) -> bool:
        return self.group.aborted or self._inner_done()

    def wait(self) -> bool:
        if self.group.aborted:
            raise RuntimeError("NCCL communicator was aborted")
        if not self._inner_done():  # NCCL's wait() returns at once; the channel only calls it once complete
            raise RuntimeError("wait() on a collective that has not completed")
        return True

    def pending(self) -> bool:
        return not self.group.aborted and not self._inner_done()


class NcclLikeGroup:
    """A gloo group with NCCL's behaviour towards a missing member (module doc)."""

    def __init__(self, inner, watchdog_s: float):
        self.inner, self.watchdog_s = inner, watchdog_s
        self.aborted = False
        self.works: list[NcclLikeWork] = []
        _groups.add(self)
        _start_watchdog()

    def broadcast(self, tensor, root):
        work = NcclLikeWork(self.inner.broadcast(tensor, root), self)
        self.works.append(work)
        return work

    def abort(self) -> None:
        self.aborted = True

    def overdue(self) -> NcclLikeWork | None:
        now = time.monotonic()
        return next((w for w in list(self.works) if w.pending() and now - w.posted > self.watchdog_s), None)


def _start_watchdog() -> None:
    if _watchdog_started.is_set():
        return
    _watchdog_started.set()
    threading.Thread(target=_watch, daemon=True, name="nccl-standin-watchdog").start()


def _watch() -> None:
    while True:
        time.sleep(0.1)
        for group in list(_groups):
            if group.overdue() is not None:
                sys.stderr.write(f"[nccl-standin] watchdog: a collective pending for over {group.watchdog_s} s: "
                                 "ending the process (as torch's NCCL watchdog does)\n")
                sys.stderr.flush()
                os._exit(WATCHDOG_EXIT)


def patch_delta_groups(watchdog_s: float, gloo_timeout_s: float = 120.0) -> None:
    """Every delta channel made in this process from now on gets an NcclLikeGroup over a real gloo group (gloo's own
    timeout set beyond the scenario's length, so that only the stand-in's watchdog decides)."""
    import torch.distributed as dist

    from marlaas_hpc.runtime.delta import broadcast

    def make(backend, store, member, size, timeout, setup_timeout=None, **kwargs):
        # set up as the channel asks (its deadline bounds gloo's rendezvous), then gloo's own timeout out of the way
        inner = dist.ProcessGroupGloo(store, member, size, setup_timeout or timedelta(seconds=gloo_timeout_s))
        inner.set_timeout(timedelta(seconds=gloo_timeout_s))
        return NcclLikeGroup(inner, watchdog_s)

    broadcast.process_group = make
