"""Quantities with units in workload files: '8 ms', '1.5 s', '25 GB/s', '40 KB'.

Every dimensioned field of a workload must say its unit; a bare number is refused, because a stage time of
`0.2` could mean seconds or milliseconds and a wrong guess silently scales every prediction.
"""
from __future__ import annotations

import re

from marlaas_hpc.tasks.spec import SpecError

TIME, SIZE, BANDWIDTH, TOKENS = "time", "size", "bandwidth", "tokens"

_UNITS = {
    TIME: {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9, "min": 60.0},
    SIZE: {"B": 1.0, "KB": 1e3, "MB": 1e6, "GB": 1e9, "KiB": 1024.0, "MiB": 1024.0**2, "GiB": 1024.0**3},
    BANDWIDTH: {"B/s": 1.0, "KB/s": 1e3, "MB/s": 1e6, "GB/s": 1e9, "Gbit/s": 1e9 / 8, "Mbit/s": 1e6 / 8},
}
_QUANTITY = re.compile(r"^\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*([A-Za-z/]+)\s*$")
BASE_UNIT = {TIME: "s", SIZE: "B", BANDWIDTH: "B/s", TOKENS: "tokens"}


def parse_quantity(value, dimension: str, field_name: str) -> float:
    """The value in base units (seconds, bytes, bytes/s); tokens are plain numbers."""
    if dimension == TOKENS:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise SpecError(field_name, f"must be a number of tokens, got {value!r}")
        return float(value)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        raise SpecError(field_name, f"missing unit in {value!r}: write it as '{value} {BASE_UNIT[dimension]}' "
                                    f"(units: {', '.join(_UNITS[dimension])})")
    match = _QUANTITY.match(str(value))
    if not match:
        raise SpecError(field_name, f"{value!r} is not a {dimension} quantity like '12 {BASE_UNIT[dimension]}'")
    number, unit = float(match.group(1)), match.group(2)
    if unit not in _UNITS[dimension]:
        raise SpecError(field_name, f"unit {unit!r} is not a {dimension} unit (known: {', '.join(_UNITS[dimension])})")
    return number * _UNITS[dimension][unit]


def format_quantity(value: float, dimension: str) -> str:
    """Writes a base-unit value back with a readable unit (calibration output)."""
    if dimension == TOKENS:
        return value
    if dimension == TIME:
        for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
            if abs(value) >= scale or unit == "us":
                return f"{value / scale:.6g} {unit}"
    if dimension == SIZE:
        for unit in ("GB", "MB", "KB", "B"):
            if abs(value) >= _UNITS[SIZE][unit] or unit == "B":
                return f"{value / _UNITS[SIZE][unit]:.6g} {unit}"
    for unit in ("GB/s", "MB/s", "KB/s", "B/s"):
        if abs(value) >= _UNITS[BANDWIDTH][unit] or unit == "B/s":
            return f"{value / _UNITS[BANDWIDTH][unit]:.6g} {unit}"
    raise ValueError(dimension)
