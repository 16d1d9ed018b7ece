"""A tenant's own dataset scored by their own function (`dataset.kind: custom`), and the reward function named by a
spec's `dataset.reward_fn` for any kind: a tenant file's function runs only in a sandboxed worker
(env/tenant_code.py)."""
from __future__ import annotations

from typing import Callable

from marlaas_hpc.env.tenant_code import SandboxConfig, reward_function as sandboxed_function
from marlaas_hpc.tasks.base import Sample
from marlaas_hpc.tasks.files import FileTask, read_jsonl
from marlaas_hpc.tasks.spec import DatasetSpec


def reward_function(spec: DatasetSpec, sandbox=None) -> Callable[[Sample, str], float]:
    """The spec's reward_fn: a tenant file's function, run only in a sandboxed worker (`sandbox` is the job's
    SandboxConfig), or a function of this package."""
    limits = (sandbox or SandboxConfig()).reward_limits()
    return sandboxed_function(spec.reward_fn or "", limits, read_files=(spec.path, getattr(spec, "corpus", None)))


class CustomTask(FileTask):
    """A user's JSONL ({"prompt": ..., "answer": ..., any other fields}) scored by their own function."""

    kind = "custom"

    def __init__(self, spec: DatasetSpec, sandbox=None):
        self._reward_fn = reward_function(spec, sandbox)
        rows = read_jsonl(spec.path, ("prompt", "answer"))
        samples = [Sample(i, row["prompt"], row["answer"],
                          {k: v for k, v in row.items() if k not in ("prompt", "answer")})
                   for i, row in enumerate(rows)]
        super().__init__(spec, samples)

    def score(self, sample: Sample, completion: str) -> float:
        return self._reward_fn(sample, completion)
