"""Library notices a normal run does not print: each says something the project chose on purpose, once per rank,
between the per-task progress lines. Installed at the start of every rank process (runtime/main.py), before the
libraries are imported; anything else a library warns about still shows."""
from __future__ import annotations

import logging
import os
import warnings

NOTICES = (
    # megatron-core and mbridge at import: the trainer uses megatron's local spec and torch's optimizers by design
    (UserWarning, r"(Transformer Engine and Apex are|Apex is) not installed"),
    # megatron-core's TransformerConfig about its own default cuda_graph_scope (the trainer captures no CUDA graph)
    (UserWarning, r"full scope is deprecated"),
    # vLLM's kernel-override scan reads torch.distributed's deprecated alias while walking modules
    (FutureWarning, r"`torch\.distributed\.reduce_op` is deprecated"),
)
QUIET_LOGGERS = (
    "vllm.triton_utils.importing",  # "Triton is installed, but doesn't include CPU backend": the CPU twin
)


def silence_library_notices() -> None:
    # transformers' and huggingface_hub's progress bars ("Loading weights: 100%|...") as each rank loads its model:
    # one per rank, interleaved with rank 0's lines; a site that wants them sets the variable to 0
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    # torch's C++ warnings outside a Python call (read once, when torch is imported: ranks import it later): vLLM's
    # CPU worker prints "NUMA binding: Using MEMBIND policy ..." from init_cpu_memory_env as every CPU-twin rollout
    # rank starts. C++ errors still show; a site that wants the warnings sets TORCH_CPP_LOG_LEVEL=WARNING
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    for category, message in NOTICES:
        warnings.filterwarnings("ignore", message=message, category=category)
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
