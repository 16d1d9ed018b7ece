"""The names of every task kind (`dataset.kind`), defined once: specs are checked against them here, without the
code that builds each kind's data (env/kinds.py `build_task_data`: the tasks' own data streams and the env's
workloads, which need tools and sandboxes that this package does not import)."""
from __future__ import annotations

from marlaas_hpc.tasks.synthetic import GENERATORS

SYNTHETIC_KINDS = tuple(GENERATORS)
"""Single-turn synthetic tasks for the tiny char model (tasks/synthetic.py)."""
ENV_TASK_KINDS = ("gsm8k_tool", "gsm8k_plain", "hotpotqa", "lookup")
"""Tool / multi-turn workloads (env/workloads.py): episodes of several model turns with tool observations."""
GSM8K_KINDS = ("gsm8k", "math", "gsm8k_synth", "gsm8k_easy", "gsm8k_tool", "gsm8k_plain")
"""Kinds whose prompts are worded for the prompt format and whose answers follow `dataset.answer_format`."""
TASK_KINDS = (frozenset(SYNTHETIC_KINDS) | {"gsm8k", "math", "gsm8k_synth", "gsm8k_easy", "custom"}
              | frozenset(ENV_TASK_KINDS))
"""Every kind: the above, GSM8K from a file or generated (multi-step, or one-step: gsm8k_easy), a math dataset on
disk, and a tenant's own dataset (`custom`, env/custom.py)."""
