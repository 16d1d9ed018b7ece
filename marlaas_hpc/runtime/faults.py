"""Whose fault is an error: a task's (it fails alone, the job goes on) or the job's (a peer rank gone, the
filesystem full or broken: the rank must die, so the job stops, names the rank, and resumes from its
checkpoints instead of failing tasks that did nothing wrong)."""
from __future__ import annotations

import errno

PEER_LOST_MARKERS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "gloo/transport",
                     "NCCL error", "ProcessGroupNCCL", "Socket Timeout", "failed to recv", "failed to send")
"""Text of the RuntimeErrors gloo / NCCL raise when the other end of a collective is gone (torch raises a plain
RuntimeError for gloo's `Connection closed by peer`)."""

STORAGE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO, errno.EFBIG, errno.ESTALE}
"""Disk full, quota exceeded, read-only or failing filesystem, file too large, stale NFS handle."""


def is_peer_lost(exc: BaseException) -> bool:
    """A collective or message failed because another rank died (a consequence, not a cause)."""
    try:
        import torch.distributed as dist

        if isinstance(exc, dist.DistError):
            return True
    except ImportError:
        pass
    if type(exc).__module__.startswith("mpi4py"):
        return True
    return isinstance(exc, RuntimeError) and any(marker in str(exc) for marker in PEER_LOST_MARKERS)


def is_storage_error(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in STORAGE_ERRNOS


def is_job_fault(exc: BaseException) -> bool:
    """No task caused it: re-raise instead of failing the task (or tasks) at hand."""
    return is_peer_lost(exc) or is_storage_error(exc)


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"
