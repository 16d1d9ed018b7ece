"""Resident memory of this process (Linux /proc), to compare `marlaas plan`'s estimate with CPU runs.

On the CPU the trainer's tensors are host memory: a run's peak RSS is the estimate's figures (float32 weights,
the dense attention of the CPU twin) plus what the process holds before the model exists (the Python heap, torch,
megatron-core and transformers: its `baseline`). `reset_peak` makes the kernel's high-water mark start again, so a
step's peak is measured without the load before it (mbridge reads the safetensors through mmap: the file's pages
count in RSS while the weights are copied, a transient the estimate does not model).
"""
from __future__ import annotations

from pathlib import Path

_STATUS = Path("/proc/self/status")


def _status_kib(key: str) -> int:
    for line in _STATUS.read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{_STATUS} has no {key}")


def rss_bytes() -> int:
    """Resident memory now."""
    return 1024 * _status_kib("VmRSS")


def peak_rss_bytes() -> int:
    """The high-water mark of resident memory since the process started or `reset_peak`."""
    return 1024 * _status_kib("VmHWM")


def reset_peak() -> None:
    """Restarts the high-water mark at the current RSS (Linux >= 4.0: clear_refs 5)."""
    Path("/proc/self/clear_refs").write_text("5")
