"""Whose fault is an error: a task's (it fails alone, the job goes on) or the job's (a peer rank gone, the
filesystem full or broken: the rank must die, so the job stops, names the rank, and resumes from its
checkpoints instead of failing tasks that did nothing wrong)."""
from __future__ import annotations

import errno
import os
import re

PEER_LOST_MARKERS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "gloo/transport",
                     "NCCL error", "ProcessGroupNCCL", "Socket Timeout", "failed to recv", "failed to send")
"""Text of the RuntimeErrors gloo / NCCL raise when the other end of a collective is gone (torch raises a plain
RuntimeError for gloo's `Connection closed by peer`)."""

STORAGE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO, errno.EFBIG, errno.ESTALE}
"""Disk full, quota exceeded, read-only or failing filesystem, file too large, stale NFS handle."""


class RankLostError(ConnectionError):
    """A rank this one was waiting on is lost (runtime/membership.py): the wait can never end."""

    def __init__(self, rank: int, kind: str):
        super().__init__(f"rank {rank} ({kind}) is lost: peer gone")
        self.rank, self.kind = rank, kind


class GroupFault(ConnectionError):
    """A trainer group gave up on a step that failed on another of its ranks (runtime/group_guard.py): this rank
    ends with it (a consequence, like a peer lost; the failed rank names the cause)."""


class GroupGaveUp(RuntimeError):
    """This rank's own failure (out of memory, or a peer's take-down it could not recover from) kept failing the
    same step on every try: the rank ends, and its trainer group's tasks go back to their checkpoints, failing none
    of them."""


class JobCannotGoOn(RuntimeError):
    """Rank 0, after a rank's loss that the job does not survive (the last rank of a kind, a trainer group with
    no other to take its tasks): the job stops, and the supervisor names the lost rank, with this as the why."""


def is_peer_lost(exc: BaseException) -> bool:
    """A collective or message failed because another rank died (a consequence, not a cause)."""
    if isinstance(exc, (RankLostError, JobCannotGoOn, GroupFault)):
        return True
    try:
        import torch.distributed as dist

        if isinstance(exc, dist.DistError):
            return True
    except ImportError:
        pass
    if type(exc).__module__.startswith("mpi4py"):
        return True
    return isinstance(exc, RuntimeError) and any(marker in str(exc) for marker in PEER_LOST_MARKERS)


_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")


def storage_errno(exc: BaseException) -> int | None:
    """The errno of an OSError with one of STORAGE_ERRNOS, or of a native library's error that wraps one
    (safetensors: "I/O error: No space left on device (os error 28)"); else None."""
    if isinstance(exc, OSError):
        return exc.errno if exc.errno in STORAGE_ERRNOS else None
    match = _RUST_OS_ERROR.search(str(exc))
    return int(match.group(1)) if match is not None and int(match.group(1)) in STORAGE_ERRNOS else None


def is_storage_error(exc: BaseException) -> bool:
    return storage_errno(exc) is not None


def storage_error(exc: BaseException, what: str) -> OSError:
    """The OSError to raise for a storage error while writing `what` (the path named in the message)."""
    code = storage_errno(exc)
    return OSError(code, f"{os.strerror(code)}: cannot write {what}")


def is_out_of_memory(exc: BaseException) -> bool:
    """A device or host allocation failed: this rank's state, not the task's (the leader alone holds posted delta
    buffers; another task's batch may be what filled the device)."""
    return isinstance(exc, (MemoryError, _torch_oom())) or (
        isinstance(exc, RuntimeError) and any(marker in str(exc) for marker in OOM_MARKERS))


OOM_MARKERS = ("out of memory", "can't allocate memory", "CUBLAS_STATUS_ALLOC_FAILED")
"""Text of allocation failures raised as plain RuntimeErrors (the CPU allocator, cuBLAS, NCCL's own buffers)."""


def _torch_oom() -> type:
    try:
        import torch

        return torch.OutOfMemoryError
    except ImportError:
        return MemoryError


def is_job_fault(exc: BaseException) -> bool:
    """No task caused it: re-raise instead of failing the task (or tasks) at hand."""
    return is_peer_lost(exc) or is_storage_error(exc) or isinstance(exc, GroupGaveUp)


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"
