"""A tenant's own dataset scored by their own function (`dataset.kind: custom`), and the reward function named by a
spec's `dataset.reward_fn` for any kind: a tenant file's function runs only in a sandboxed worker
(env/tenant_code.py)."""
from __future__ import annotations

from typing import Callable

from marlaas_hpc.env.tenant_code import SandboxConfig, reward_function as sandboxed_function
from marlaas_hpc.tasks.base import Sample
from marlaas_hpc.tasks.files import FileTask
from marlaas_hpc.tasks.gsm8k import check_message_prompts
from marlaas_hpc.tasks.dataset_files import read_records
from marlaas_hpc.tasks.spec import DatasetSpec


def reward_function(spec: DatasetSpec, sandbox=None) -> Callable[[Sample, str], float]:
    """The spec's reward_fn: a tenant file's function, run only in a sandboxed worker (`sandbox` is the job's
    SandboxConfig), or a function of this package."""
    limits = (sandbox or SandboxConfig()).reward_limits()
    return sandboxed_function(spec.reward_fn or "", limits, read_files=(spec.path, getattr(spec, "corpus", None)))


CUSTOM_FIELDS = {"prompt": "prompt", "answer": "answer"}
"""Default columns of a tenant's dataset."""


class CustomTask(FileTask):
    """A user's dataset (tasks/dataset_files.py: JSONL, JSON, parquet or a save_to_disk folder; {"prompt": ...,
    "answer": ..., any other columns}, or the columns `dataset.fields` names) scored by their own function. The
    function sees the other columns as `sample.meta`, and a chat-message prompt as a list of messages."""

    kind = "custom"

    def __init__(self, spec: DatasetSpec, prompt_format: str = "raw", sandbox=None):
        self._reward_fn = reward_function(spec, sandbox)
        records = read_records(spec.path, spec.fields, CUSTOM_FIELDS, spec.split)
        check_message_prompts(records, prompt_format)
        super().__init__(spec, [Sample(i, r.prompt, r.answer, r.extra) for i, r in enumerate(records)])

    def score(self, sample: Sample, completion: str) -> float:
        return self._reward_fn(sample, completion)
