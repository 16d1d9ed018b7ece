"""Where the project caches what it builds once per machine: the tiny and random-weight base models, vLLM's and
inductor's compile caches. `MARLAAS_CACHE` moves it (default ~/.cache/marlaas_hpc)."""
from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    return Path(os.environ.get("MARLAAS_CACHE", Path.home() / ".cache" / "marlaas_hpc"))
