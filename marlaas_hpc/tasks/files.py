"""File-backed tasks: reading JSONL data files, the seeded split of a fixed sample list (`FileTask`, which the
env's file workloads and tenant datasets build on), GSM8K-format JSONL (math-verify reward)."""
from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from marlaas_hpc.tasks.base import Sample, TaskData
from marlaas_hpc.tasks.gsm8k import Gsm8kTask, gsm8k_file_samples
from marlaas_hpc.tasks.spec import DatasetSpec, SpecError


def read_jsonl_rows(path: str | None, required: tuple[str, ...] = (), field_name: str = "dataset.path",
                    what: str = "no samples") -> list[tuple[int, dict[str, Any]]]:
    """(line number, object) of every non-blank line; any problem is a SpecError naming file and line."""
    if not path:
        raise SpecError(field_name, "no data file given")
    file = Path(path)
    if not file.is_file():
        raise SpecError(field_name, f"data file not found: {file}")
    rows = []
    for lineno, raw in enumerate(file.read_bytes().split(b"\n"), start=1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise SpecError(field_name, f"{file}:{lineno}: not UTF-8 text ({exc.reason} at column {exc.start + 1})"
                            ) from None
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise SpecError(field_name, f"{file}:{lineno}: malformed JSON ({exc.msg})") from None
        if not isinstance(row, dict):
            raise SpecError(field_name, f"{file}:{lineno}: expected a JSON object")
        missing = [key for key in required if not isinstance(row.get(key), str) or not row[key].strip()]
        if missing:
            raise SpecError(field_name, f"{file}:{lineno}: missing, empty or non-string field(s) {missing}")
        rows.append((lineno, row))
    if not rows:
        raise SpecError(field_name, f"{file}: {what} (no non-blank line)")
    return rows


def read_jsonl(path: str | None, required: tuple[str, ...], field_name: str = "dataset.path") -> list[dict[str, Any]]:
    """The objects of a JSONL data file (see read_jsonl_rows)."""
    return [row for _, row in read_jsonl_rows(path, required, field_name)]


class FileTask(TaskData):
    """Seeded split of a fixed list of samples; the train stream cycles through a seeded permutation."""

    def __init__(self, spec: DatasetSpec, samples: list[Sample]):
        order = list(range(len(samples)))
        random.Random(spec.seed).shuffle(order)
        n_eval = min(spec.eval_size, max(1, len(samples) // 5)) if len(samples) > 1 else 0
        self._eval = [samples[i] for i in order[:n_eval]]
        self._train = [samples[i] for i in order[n_eval:]] or self._eval
        self._seed = spec.seed

    def train_sample(self, cursor: int) -> Sample:
        epoch, offset = divmod(cursor, len(self._train))
        order = list(range(len(self._train)))
        random.Random(f"{self._seed}-{epoch}").shuffle(order)
        return self._train[order[offset]]

    def eval_samples(self) -> list[Sample]:
        return list(self._eval)


class Gsm8kFileTask(Gsm8kTask, FileTask):
    """GSM8K format: {"question": ..., "answer": "... #### N"} per line; reward by math-verify."""

    kind = "gsm8k"

    def __init__(self, spec: DatasetSpec, prompt_format: str = "raw"):
        self.answer_format = spec.answer_format
        super().__init__(spec, gsm8k_file_samples(spec, prompt_format))
