"""Checkpoints: periodic per task (crash safety), every task at once on preemption, and resume at exactly the
versions saved.

Periodic (`CheckpointConfig`, job config `checkpoint:`). After a task's step to version v, once `every_steps`
steps or `every_minutes` have passed since its last save, every TP rank saves that task's shard (adapter,
optimizer state, version) to `tasks/<tenant>/<task>/checkpoint/tp<r>-v<version>.pt` with a sha256 sidecar, and
the trainer leader tells rank 0 (`TaskSaved`, sent just before the task's StepDone of v). Handling that StepDone,
rank 0 appends the task's record (its scheduler state at v) to its journal, `checkpoint/records.jsonl`, before
it issues anything that depends on v. Other tasks never wait: only the task's own step pays the save, and the
record is one line whatever the number of tasks. A rank that dies therefore costs each task at most one
interval of steps.

The journal (runtime/records.py: format, compaction, damaged lines) holds per task `saved` (the scheduler state
at its newest checkpoint, or at submission) and `previous` (at the checkpoint before, used when a shard of the
newest is missing or corrupt), plus the evals, refused specs and the history of runs. Trainer ranks keep the
newest KEEP_SHARDS shards of each task, so both records' shards exist.

Preemption (SIGUSR2: Slurm's `--signal=USR2@lead`, `scancel --signal=USR2`, or mpirun forwarding it) sets a
flag on every rank; only rank 0 acts on it:
1. the scheduler drains: it issues nothing new, and the groups in flight are generated, scored and, where
   a Train order was already out, trained;
2. once nothing is in flight (`Scheduler.settled`) and no eval is pending, rank 0 sends `Checkpoint` to the
   trainer leader; every TP rank saves each live task's shard and its RNG, and the leader answers with the
   versions;
3. rank 0 records every task at those versions, leaves the requeue marker and shuts the job down (status 75).

Resume (`marlaas run --resume RUN_DIR`, or a requeued Slurm job): every trainer rank checks the shards the
records name (runtime/recovery.py); per task rank 0 takes the newest record whose shards verify on every TP
rank, rolls audit.jsonl and the task's metrics.jsonl back to its version, and re-admits the task there (the
trainer restores the shard and republishes it to the rollout ranks). Groups in flight or scored but not trained
at the record are counted as `preempted_groups` and never trained later, so every version is trained exactly
once over all runs.
"""
from __future__ import annotations

import hashlib
import io
import os
import re
import signal
import time
from pathlib import Path
from typing import Callable

from marlaas_hpc.rundir import CheckpointConfig
from marlaas_hpc.runtime.records import JobRecords, checkpoint_file, load_job_checkpoint, read_records  # noqa: F401

KEEP_SHARDS = 3
"""Shards kept per task and TP rank: the newest two records' shards must exist while rank 0 may still be one
save behind the trainer (it records a save when it handles the StepDone that follows it)."""


class CheckpointPolicy:
    """Which task is due for a save after a step (the trainer leader asks it). Pure: clock injected."""

    def __init__(self, config: CheckpointConfig, clock: Callable[[], float] = time.time):
        self.config, self.clock = config, clock
        self.last: dict[str, tuple[int, float]] = {}
        """task -> (version, time) of its last save (or of its admission)."""

    def admitted(self, task_id: str, version: int) -> None:
        self.last[task_id] = (version, self.clock())

    def due(self, task_id: str, version: int) -> bool:
        if task_id not in self.last:
            return False
        saved_version, saved_at = self.last[task_id]
        if version <= saved_version:
            return False
        every_steps, every_s = self.config.every_steps, self.config.every_minutes * 60
        return bool((every_steps and version - saved_version >= every_steps)
                    or (every_s and self.clock() - saved_at >= every_s))

    def saved(self, task_id: str, version: int) -> None:
        self.last[task_id] = (version, self.clock())

    def forget(self, task_id: str) -> None:
        self.last.pop(task_id, None)

    def hand_over(self, task_id: str) -> tuple[int, float] | None:
        """A task moves to another trainer group: its last save (version, time), which that group's policy takes
        over, so that work lost in a crash stays within one interval across the move."""
        return self.last.pop(task_id, None)

    def take_over(self, task_id: str, last: tuple[int, float] | None) -> None:
        if last is not None:
            self.last[task_id] = last


# ---- files ----
def requeue_marker(run_dir: Path) -> Path:
    """Left by rank 0 when the job stopped at a checkpoint (the plain sbatch script requeues on it);
    removed when a run resumes."""
    return Path(run_dir) / "checkpoint" / "REQUEUE"


def shard_name(tp_rank: int, ep_rank: int = 0) -> str:
    """A trainer rank's share of a task's state: its TP rank's slices, and under expert parallelism (layout.trainer_ep)
    its EP rank's experts ('tp0', 'tp0-ep1'). DP replicas of one share write one file."""
    return f"tp{tp_rank}" if ep_rank == 0 else f"tp{tp_rank}-ep{ep_rank}"


def role_shard(role, trainer_ep: int) -> str:
    """The share of a trainer rank from its place in the layout (before its trainer exists): the EP groups are
    consecutive DP ranks (megatron-core's order at TP 1), so its EP rank is its DP rank modulo trainer_ep."""
    return shard_name(role.tp_rank, role.dp_rank % trainer_ep)


def trainer_shard_path(run_dir: Path, spec, shard: str, version: int) -> Path:
    from marlaas_hpc.rundir import task_dir

    return task_dir(Path(run_dir), spec) / "checkpoint" / f"{shard}-v{version:06d}.pt"


def rng_state() -> dict:
    """This process's random state as a trainer rank uses it: torch's CPU generator, the current CUDA device's
    (on a GPU), and megatron's model-parallel generators (its CUDA RNG tracker: dropout and init inside TP
    regions)."""
    import torch
    from megatron.core import tensor_parallel

    state = {"cpu": torch.get_rng_state(), "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state) -> None:
    """Restores what `rng_state` saved (a bare tensor: a file from before the CUDA and tracker states were
    kept, torch's CPU generator only)."""
    import torch
    from megatron.core import tensor_parallel

    if isinstance(state, torch.Tensor):
        torch.set_rng_state(state)
        return
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if state.get("tracker"):
        tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def trainer_rng_path(run_dir: Path, tp_rank: int, group: int = 0, dp_rank: int = 0) -> Path:
    """One trainer rank's RNG state (trainer group 0, DP replica 0: the one-group name)."""
    if group == dp_rank == 0:
        return Path(run_dir) / "checkpoint" / f"trainer-rng-tp{tp_rank}.pt"
    return Path(run_dir) / "checkpoint" / f"trainer-rng-g{group}-dp{dp_rank}-tp{tp_rank}.pt"


def _digest_path(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def on_host(obj):
    """`obj` with every tensor in it copied to host memory (dicts, lists and tuples followed): a shard pickled
    from GPU tensors names their device, and loading it where that device is missing (another node's numbering,
    a CPU-only machine reading a checkpoint) fails."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu() if obj.device.type != "cpu" else obj
    if isinstance(obj, dict):
        return {key: on_host(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(on_host(value) for value in obj)
    return obj


def save_torch(obj, path: Path) -> None:
    """Atomic torch.save with a sha256 sidecar: a crash mid-write leaves the previous files intact, and a shard
    without a matching sidecar (cut short, overwritten, bit rot) is never loaded. Tensors are saved from host
    memory (`on_host`)."""
    import torch

    buffer = io.BytesIO()
    torch.save(on_host(obj), buffer)
    data = buffer.getvalue()
    _atomic_write_bytes(path, data)
    _atomic_write_bytes(_digest_path(path), (hashlib.sha256(data).hexdigest() + "\n").encode())


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as sink:
        sink.write(data)
        sink.flush()
        os.fsync(sink.fileno())
    os.replace(tmp, path)


class CorruptCheckpoint(RuntimeError):
    """A shard that is missing, cut short or does not match its sha256 sidecar."""


def read_verified(path: Path) -> bytes:
    """The bytes of a shard, checked against its sidecar; raises CorruptCheckpoint naming the file."""
    digest = _digest_path(path)
    if not path.is_file():
        raise CorruptCheckpoint(f"{path} is missing")
    if not digest.is_file():
        raise CorruptCheckpoint(f"{path} has no {digest.name} (its write was cut short)")
    data = path.read_bytes()
    if hashlib.sha256(data).hexdigest() != digest.read_text().strip():
        raise CorruptCheckpoint(f"{path} is corrupt (sha256 differs from {digest.name})")
    return data


def load_torch(path: Path):
    import torch

    # host tensors: a shard written before `on_host` may name a GPU this process does not have
    return torch.load(io.BytesIO(read_verified(path)), weights_only=False, map_location="cpu")


_SHARD = re.compile(r"(tp\d+(?:-ep\d+)?)-v(\d+)\.pt$")


def prune_shards(folder: Path, shard: str, newest: int | None) -> None:
    """Keeps this share's (`shard_name`) KEEP_SHARDS newest shards up to version `newest` and deletes the rest, newer
    ones included (left by an earlier job in the run dir, or by a run that was rolled back). None: deletes all."""
    if not folder.is_dir():
        return
    mine = {}
    for path in folder.iterdir():
        match = _SHARD.match(path.name)
        if match and match.group(1) == shard:
            mine[int(match.group(2))] = path
    keep = set() if newest is None else set(sorted(v for v in mine if v <= newest)[-KEEP_SHARDS:])
    for version, path in mine.items():
        if version not in keep:
            path.unlink(missing_ok=True)
            _digest_path(path).unlink(missing_ok=True)


def mark_preempted(run_dir: Path) -> None:
    requeue_marker(run_dir).write_text(f"{time.time()}\n")


class PreemptFlag:
    """Set by SIGUSR2. A signal handler only flips a flag: rank 0's loop notices it between messages, so
    the drain never starts inside an MPI call or half-way through a scheduler update."""

    def __init__(self):
        self.requested_at: float | None = None

    @property
    def requested(self) -> bool:
        return self.requested_at is not None

    def request(self, *_args) -> None:
        if self.requested_at is None:
            self.requested_at = time.time()

    @classmethod
    def install(cls) -> "PreemptFlag":
        """On every rank (the signal's default action would kill a rank that has no handler)."""
        flag = cls()
        signal.signal(signal.SIGUSR2, flag.request)
        return flag
