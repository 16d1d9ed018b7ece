"""Preemption: checkpoint every task at a step boundary and resume at exactly the versions reached.

Protocol (DESIGN.md §8). A SIGUSR2 (Slurm's `--signal=USR2@lead` before the time limit, `scancel
--signal=USR2`, or mpirun forwarding it) sets a flag on every rank; only rank 0 acts on it:
1. the scheduler drains: it issues nothing new, and the groups in flight are generated, scored and, where
   a Train order was already out, trained;
2. once nothing is in flight (`Scheduler.settled`) and no eval is pending, rank 0 sends `Checkpoint` to the
   trainer leader; every TP rank saves each live task's adapter shard and optimizer state
   (`tasks/<tenant>/<task>/checkpoint/tp<r>.pt`) and its RNG, and the leader answers with the versions;
3. rank 0 writes `checkpoint/scheduler.json` (per task: version, data cursor, counters, step times; the
   audit so far; evals; rejected specs; the history of runs) and shuts the job down.
On resume every unfinished task is re-admitted at its saved version (the trainer restores the shard and
republishes it to the rollout ranks); groups that were scored but not trained are counted as
`preempted_groups`, never trained later, so no optimizer step is lost or applied twice.
"""
from __future__ import annotations

import json
import signal
import time
from dataclasses import asdict
from pathlib import Path

from marlaas_hpc.runtime.outputs import atomic_write_text

FORMAT = 1


def checkpoint_file(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoint" / "scheduler.json"


def requeue_marker(run_dir: Path) -> Path:
    """Left by rank 0 when the job stopped at a checkpoint (the plain sbatch script requeues on it);
    removed when a run resumes."""
    return Path(run_dir) / "checkpoint" / "REQUEUE"


def trainer_shard_path(run_dir: Path, spec, tp_rank: int) -> Path:
    from marlaas_hpc.driver import task_dir

    return task_dir(Path(run_dir), spec) / "checkpoint" / f"tp{tp_rank}.pt"


def trainer_rng_path(run_dir: Path, tp_rank: int, group: int = 0, dp_rank: int = 0) -> Path:
    """One trainer rank's RNG state (trainer group 0, DP replica 0: the one-group name)."""
    if group == dp_rank == 0:
        return Path(run_dir) / "checkpoint" / f"trainer-rng-tp{tp_rank}.pt"
    return Path(run_dir) / "checkpoint" / f"trainer-rng-g{group}-dp{dp_rank}-tp{tp_rank}.pt"


def save_torch(obj, path: Path) -> None:
    """Atomic torch.save: a crash mid-write leaves the previous checkpoint intact."""
    import os

    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def save_job_checkpoint(run_dir: Path, scheduler, evals: dict, rejected: dict, runs: list[dict]) -> Path:
    state = {
        "format": FORMAT, "saved_at": time.time(), "runs": runs,
        "tasks": {task_id: {"spec": task.spec.to_dict(), **task.checkpoint()}
                  for task_id, task in scheduler.tasks.items()},
        "audit": [asdict(record) for record in scheduler.audit],
        "evals": [{"task_id": task_id, "when": when, "scores": scores} for (task_id, when), scores in evals.items()],
        "rejected": rejected,
    }
    path = checkpoint_file(run_dir)
    atomic_write_text(path, json.dumps(state, indent=1) + "\n")
    requeue_marker(run_dir).write_text(f"{time.time()}\n")
    return path


def load_job_checkpoint(run_dir: Path) -> dict | None:
    path = checkpoint_file(run_dir)
    if not path.is_file():
        return None
    state = json.loads(path.read_text())
    if state.get("format") != FORMAT:
        raise ValueError(f"{path}: checkpoint format {state.get('format')!r}, this version reads {FORMAT}")
    return state


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
