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
QUIET_MESSAGES = (
    # math-verify off the main thread (an env pool's worker): its SIGALRM timeouts cannot run there, so the env
    # pool's per-call timeout bounds the call instead (tasks/gsm8k.py); the library says so once per process
    ("math_verify.grader", "Timeout is disabled as timeout_seconds is None"),
    # vLLM 0.32's LLM renders a chat template as it starts; the engines start with skip_tokenizer_init (prompts go
    # in as token ids, rollout/vllm_engine.py), so there is no tokenizer to render with, and it warns with a traceback
    ("vllm.renderers.base", "Chat template warmup failed"),
)
PYTHON_WARNINGS = "ignore::UserWarning:multiprocessing.resource_tracker"
"""PYTHONWARNINGS for the processes a rank starts (read by each new interpreter): an engine core in a process of
its own (rollout/vllm_engine.py `start_llm`) leaves its shared-memory queues and semaphores to Python's resource
tracker when it is shut down; the tracker unlinks them and says "There appear to be N leaked ..." as the job ends."""


class _DropMessage(logging.Filter):
    def __init__(self, start: str):
        super().__init__()
        self.start = start

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.start)


def silence_library_notices() -> None:
    # transformers' and huggingface_hub's progress bars ("Loading weights: 100%|...") as each rank loads its model:
    # one per rank, interleaved with rank 0's lines; a site that wants them sets the variable to 0
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    # torch's C++ warnings outside a Python call (read once, when torch is imported: ranks import it later): vLLM's
    # CPU worker prints "NUMA binding: Using MEMBIND policy ..." from init_cpu_memory_env as every CPU-twin rollout
    # rank starts. C++ errors still show; a site that wants the warnings sets TORCH_CPP_LOG_LEVEL=WARNING
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    os.environ.setdefault("PYTHONWARNINGS", PYTHON_WARNINGS)
    for category, message in NOTICES:
        warnings.filterwarnings("ignore", message=message, category=category)
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    for name, start in QUIET_MESSAGES:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMessage) and f.start == start for f in logger.filters):
            logger.addFilter(_DropMessage(start))
