"""Scripted policies the env tests play episodes with."""
from __future__ import annotations

import re


def solve_lookup(request, context) -> str:
    """The lookup task solved: calls the tool first, then adds the restated numbers."""
    if "<eos>" not in context:
        return "?"
    a, b = re.search(r"(\d+)\+(\d+)=$", context).groups()
    return str(int(a) + int(b))
