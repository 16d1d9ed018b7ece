"""File-backed tasks: the seeded split of a fixed sample list (`FileTask`, which the env's file workloads and
tenant datasets build on), GSM8K-format data and math datasets on disk (math-verify reward). The files are read
by tasks/dataset_files.py (JSONL, JSON, parquet, save_to_disk folders; the field map)."""
from __future__ import annotations

import random

from marlaas_hpc.tasks.base import Sample, TaskData
from marlaas_hpc.tasks.gsm8k import Gsm8kTask, gsm8k_file_samples, math_file_samples
from marlaas_hpc.tasks.dataset_files import read_jsonl_rows
from marlaas_hpc.tasks.spec import DatasetSpec

__all__ = ["FileTask", "Gsm8kFileTask", "MathFileTask", "read_jsonl_rows"]


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


class MathFileTask(Gsm8kTask, FileTask):
    """A math dataset on disk (GSM8K, MATH, verl's or TRL's parquet): the answer column holds the final answer,
    or a solution whose final answer follows '####' or sits in the last \\boxed{}; reward by math-verify."""

    kind = "math"

    def __init__(self, spec: DatasetSpec, prompt_format: str = "raw"):
        self.answer_format = spec.answer_format
        super().__init__(spec, math_file_samples(spec, prompt_format))
