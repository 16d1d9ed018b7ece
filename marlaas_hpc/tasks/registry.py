"""The names of every task kind (`dataset.kind`) and of every objective (`algo.loss`), defined once: specs are
checked against them here, without the code that builds each kind's data (env/kinds.py `build_task_data`: the
tasks' own data streams and the env's workloads, which need tools and sandboxes that this package does not
import) or computes each objective (trainer/objectives.py `OBJECTIVES`)."""
from __future__ import annotations

from marlaas_hpc.tasks.synthetic import GENERATORS

SYNTHETIC_KINDS = tuple(GENERATORS)
"""Single-turn synthetic tasks for the tiny char model (tasks/synthetic.py)."""
ENV_TASK_KINDS = ("gsm8k_tool", "gsm8k_plain", "hotpotqa", "lookup")
"""Tool / multi-turn workloads (env/workloads.py): episodes of several model turns with tool observations."""
GSM8K_KINDS = ("gsm8k", "math", "gsm8k_synth", "gsm8k_easy", "gsm8k_tool", "gsm8k_plain")
"""Kinds whose prompts are worded for the prompt format and whose answers follow `dataset.answer_format`."""
LENGTH_KINDS = ("long_tail",)
"""Synthetic kinds whose prompts set their completions' lengths (tasks/synthetic.py LongTailTask)."""
TASK_KINDS = (frozenset(SYNTHETIC_KINDS) | frozenset(LENGTH_KINDS) | {"gsm8k", "math", "gsm8k_synth", "gsm8k_easy", "custom"}
              | frozenset(ENV_TASK_KINDS))
"""Every kind: the above (heavy-tailed lengths: `long_tail`), GSM8K from a file or generated (multi-step, or one-step: gsm8k_easy), a math dataset on
disk, and a tenant's own dataset (`custom`, env/custom.py)."""


OBJECTIVE_DEFAULTS = {
    # loss:    (clip_eps, clip_eps_high, normalize_adv_std, dynamic_sampling), each from the objective's paper
    "grpo": (0.2, 0.2, True, False),  # Shao et al. 2024 (DeepSeekMath), arXiv 2402.03300
    "dr_grpo": (0.2, 0.2, False, False),  # Liu et al. 2025, arXiv 2503.20783: no std normalisation
    "dapo": (0.2, 0.28, True, True),  # Yu et al. 2025, arXiv 2503.14476 §4.1: clip-higher, dynamic sampling
    "gspo": (3e-4, 4e-4, True, False),  # Zheng et al. 2025, arXiv 2507.18071 §5.1: sequence ratios stay near 1
    # MiniMax 2025, arXiv 2506.13585 §3.1: no lower bound on the IS weight (eps_low large: 1 - 1.0 = 0) and a
    # tuned eps_high the paper does not give: DAPO's 0.28 (Trinity-RFT's CISPO default), so cispo and dapo
    # differ only in the objective, the comparison the paper makes
    "cispo": (1.0, 0.28, True, False),
}
"""Every objective a task may name in `algo.loss`, with the values its unset fields take."""
OBJECTIVES = tuple(OBJECTIVE_DEFAULTS)
KL_ESTIMATORS = ("k1", "k2", "k3")
"""Estimators of KL(pi_theta || pi_base) per token (Schulman, "Approximating KL divergence", 2020)."""
