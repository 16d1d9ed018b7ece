"""What the sandbox costs on this node, per isolation level: a one-shot python-tool run (start to exit) and a
tenant reward function (worker start, then per call), median and p90 over repeats.

    python tools/bench_sandbox.py [--runs 20] [--calls 200]
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from marlaas_hpc.env.sandbox import LEVELS, SandboxLimits, SandboxUnavailable, node_isolation, run_python  # noqa: E402
from marlaas_hpc.env.tenant_code import CodeRef, TenantFunction  # noqa: E402
from marlaas_hpc.tasks.base import Sample  # noqa: E402


def quantiles(values: list[float]) -> str:
    ordered = sorted(values)
    p90 = ordered[max(0, math.ceil(0.9 * len(ordered)) - 1)]
    return f"p50 {statistics.median(ordered) * 1e3:7.1f} ms  p90 {p90 * 1e3:7.1f} ms  (n={len(ordered)})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=20, help="one-shot runs and worker starts per level")
    parser.add_argument("--calls", type=int, default=200, help="reward calls per level")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="marlaas-bench-") as tmp:
        reward = Path(tmp) / "reward.py"
        reward.write_text("def score(sample, completion):\n    return float(completion == sample.answer)\n")
        for level in LEVELS:
            bench_level(level, reward, args.runs, args.calls)


def bench_level(level: str, reward: Path, n_runs: int, n_calls: int) -> None:
    sample = Sample(0, "1+1=", "2", {"note": "x" * 200})
    limits = SandboxLimits(isolation=level, allow_unisolated=True, wall_seconds=60, cpu_seconds=30)
    try:
        isolation = node_isolation(limits)
    except SandboxUnavailable as exc:
        print(f"{level:9s} unavailable: {exc}")
        return
    runs = []
    for _ in range(n_runs):
        start = time.perf_counter()
        assert run_python("print(6 * 7)", limits).stdout == "42\n"
        runs.append(time.perf_counter() - start)
    starts, calls = [], []
    for _ in range(max(1, n_runs // 4)):
        function = TenantFunction(CodeRef("score", path=str(reward)), limits)
        start = time.perf_counter()
        function._worker.start()
        starts.append(time.perf_counter() - start)
        function.close()
    function = TenantFunction(CodeRef("score", path=str(reward)), limits)
    function(sample, "2")
    for i in range(n_calls):
        start = time.perf_counter()
        function(sample, str(i % 3))
        calls.append(time.perf_counter() - start)
    function.close()
    print(f"{isolation.describe()}")
    print(f"  python tool run (start to exit):  {quantiles(runs)}")
    print(f"  reward worker start (load file):  {quantiles(starts)}")
    print(f"  reward call (pipe round trip):    {quantiles(calls)}")


if __name__ == "__main__":
    main()
