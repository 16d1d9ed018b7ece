"""The GPU battery (tools/gpu_battery.sh, tools/battery.py) on this CPU machine: its --cpu mode writes figures.json
with each step's command and figures, and names each skipped step with its reason (a missing module, no mpirun,
no GPU); steps run one after another under coreutils `timeout`; its step table keeps within a GPU node's
5-minute commands and the GPU memory budget. CI runs the whole --cpu battery (.ci/run)."""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import battery  # noqa: E402


def test_cpu_battery_writes_figures_and_names_what_it_skips(tmp_path):
    """Four steps with vLLM and mpirun treated as missing: the trainer's GPU tests run (and skip: no GPU here)
    without the file that needs mpirun; vLLM's GPU tests, the vLLM step and the MPI job are skipped, each with its
    reason."""
    out = tmp_path / "out"
    proc = subprocess.run(["bash", "tools/gpu_battery.sh", "--cpu", "--steps", "gpu_tests,gpu_tests_rollout,engine,job",
                           "--without", "vllm,mpirun", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    figures = json.loads((out / "figures.json").read_text())
    assert figures["mode"] == "cpu" and figures["installed"]["vllm"] is None
    assert figures["installed"]["torch"] and figures["programs"]["mpirun"] is None
    assert set(figures["steps"]) == {"gpu_tests", "gpu_tests_rollout", "engine", "job"}
    tests = figures["steps"]["gpu_tests"]
    assert tests["status"] == "ok" and tests["exit"] == 0 and "-m pytest -m" in tests["command"]
    assert "test_runtime_delta.py" not in tests["command"] and "test_gpu_trainer.py" in tests["command"]
    assert tests["figures"]["skipped"] >= 3 and tests["figures"]["failed"] == 0
    assert all("CUDA" in reason or "GPUs" in reason for reason in tests["figures"]["skips"].values())
    assert list(tests["figures"]["files_left_out"]) == ["tests/test_runtime_delta.py"]
    assert "mpirun" in tests["figures"]["files_left_out"]["tests/test_runtime_delta.py"]
    rollout, engine, job = (figures["steps"][name] for name in ("gpu_tests_rollout", "engine", "job"))
    assert rollout["status"] == "skipped" and "vllm" in rollout["reason"]
    assert engine["status"] == "skipped" and "vllm" in engine["reason"]
    assert job["status"] == "skipped" and "mpirun" in job["reason"]
    assert {s["step"]: s["reason"] for s in figures["skipped"]} == {
        "gpu_tests_rollout": rollout["reason"], "engine": engine["reason"], "job": job["reason"]}
    assert (out / "gpu_tests.log").is_file() and (out / "gpu_tests.xml").is_file()


def test_gpu_mode_without_a_gpu_skips_every_step_and_fails(tmp_path):
    """A GPU battery on a machine without one says so in figures.json and exits 1 (nothing measured)."""
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "tools/battery.py", "--part", "1", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout[-2000:]
    figures = json.loads((out / "figures.json").read_text())
    assert figures["mode"] == "gpu" and not figures["cuda"]["available"]
    part_1 = [step.name for step in battery.STEPS if step.part == 1]
    assert [s["step"] for s in figures["skipped"]] == part_1
    assert all("no CUDA device" in s["reason"] for s in figures["skipped"])


def _context(tmp_path, cpu=True, **installed) -> battery.Context:
    return battery.Context(cpu=cpu, out=tmp_path, python=sys.executable,
                           installed={m: "1" for m in battery.MODULES} | installed,
                           programs={p: f"/bin/{p}" for p in battery.PROGRAMS}, cuda={"available": True})


def _timed_step(name: str, seconds: float, timeout: int) -> battery.Step:
    """A step that sleeps `seconds` and then writes when it ran to OUT/<name>.span."""
    def argv(ctx: battery.Context) -> list[str]:
        span = str(ctx.out / f"{name}.span")
        return [ctx.python, "-c", f"import time, pathlib; start = time.time(); time.sleep({seconds}); "
                                  f"pathlib.Path({span!r}).write_text(f'{{start}} {{time.time()}}')"]

    return battery.Step(name=name, part=1, timeout_s=timeout, cpu_timeout_s=timeout, argv=argv)


def test_steps_run_one_after_another_under_timeout(tmp_path):
    """Never two steps at once; a step past its timeout is killed by `timeout` and recorded as such; a step whose
    module is missing is skipped with its reason, and the others still run."""
    ctx = _context(tmp_path, vllm=None)
    steps = [_timed_step("first", 0.5, 20), _timed_step("slow", 30, 1),
             replace(_timed_step("needs_vllm", 0, 20), modules=lambda ctx: ("vllm",)), _timed_step("last", 0.5, 20)]
    figures = {"steps": {}, "mode": "cpu"}
    battery.run_steps(steps, ctx, figures)
    records = figures["steps"]
    assert [records[n]["status"] for n in ("first", "slow", "needs_vllm", "last")] == \
        ["ok", "timeout", "skipped", "ok"]
    assert records["slow"]["exit"] == 124 and records["slow"]["seconds"] < 10
    assert "vllm" in records["needs_vllm"]["reason"]
    first, last = ([float(x) for x in (tmp_path / f"{n}.span").read_text().split()] for n in ("first", "last"))
    assert first[1] <= last[0], "the steps overlapped"
    assert not (tmp_path / "slow.span").exists()
    assert json.loads((tmp_path / "figures.json").read_text())["skipped"] == [
        {"step": "needs_vllm", "reason": records["needs_vllm"]["reason"]}]


def test_the_step_table_fits_a_gpu_node_s_window_and_memory(tmp_path):
    """Each part's timeouts add up to at most PART_BUDGET_S (a 5-minute command), --cpu's all of them; no step's
    engines take more than GPU_MEMORY_BUDGET of the GPU; a table that breaks either is refused."""
    for ctx in (_context(tmp_path, cpu=False), _context(tmp_path, cpu=True), _context(tmp_path, vllm=None)):
        battery.validate_steps(battery.STEPS, ctx)
    assert battery.PART_BUDGET_S <= 300 and battery.GPU_MEMORY_BUDGET <= 0.9
    gpu = _context(tmp_path, cpu=False)
    assert max(step.gpu_fraction(gpu) for step in battery.STEPS) <= battery.GPU_MEMORY_BUDGET
    greedy = replace(battery.STEPS[-1], gpu_fraction=lambda ctx: 2 * 0.5)
    with pytest.raises(ValueError, match="GPU_MEMORY_BUDGET"):
        battery.validate_steps((*battery.STEPS[:-1], greedy), gpu)
    slow = replace(battery.STEPS[0], timeout_s=battery.PART_BUDGET_S)
    with pytest.raises(ValueError, match="part 1"):
        battery.validate_steps((slow, *battery.STEPS[1:]), gpu)
