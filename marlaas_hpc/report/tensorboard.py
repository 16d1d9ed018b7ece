"""TensorBoard event files next to each task's metrics.jsonl, so the usual tools (tensorboard --logdir RUN_DIR/tasks)
show every task's curves. One writer per task directory, opened on the task's first step."""
from __future__ import annotations

import math
import numbers
from pathlib import Path


class TensorBoardSink:
    def __init__(self):
        self.writers: dict[Path, object] = {}

    def write(self, task_path: str | Path, record: dict) -> None:
        """Every finite number of a metrics.jsonl record as a scalar at step = the record's version."""
        writer = self._writer(Path(task_path))
        step = int(record.get("version", 0))
        for name, value in record.items():
            if name in ("version", "time") or isinstance(value, bool) or not isinstance(value, numbers.Real):
                continue
            if math.isfinite(value):
                writer.add_scalar(f"train/{name}", float(value), global_step=step, walltime=record.get("time"))
        writer.flush()  # readers (tensorboard, marlaas report) see a live job's steps

    def close(self) -> None:
        for writer in self.writers.values():
            writer.close()
        self.writers.clear()

    def _writer(self, task_path: Path):
        if task_path not in self.writers:
            from torch.utils.tensorboard import SummaryWriter  # lazy: a second or so of imports

            self.writers[task_path] = SummaryWriter(log_dir=str(task_path))
        return self.writers[task_path]
