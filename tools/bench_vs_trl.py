"""marlaas against running the same tasks one by one (issue #15), measured in one run.

    python tools/bench_vs_trl.py [--config configs/local-demo.yaml] [--modes async sequential]
                                 [--baseline auto|trl|local] [--trl-venv DIR] [--tool-workload] [--out DIR]

On the config's workload (by default local-demo: 4 tasks x 30 steps, G=8, B=8, the tiny model) it measures
- each `marlaas run` as a whole process (mpirun and every rank): its wall, start-up (launch until every rank
  is ready: summary.json's job_start) and training (summary.json wall_time_s), run-dir size, mean eval gain;
- the single-process baseline, one process per task, one after another: TRL's GRPOTrainer + PEFT in its own
  venv (tools/setup_trl_venv.sh) with the same model, prompts, reward and hyper-parameters
  (tools/trl_baseline.py); without that venv, the project's LocalDriver per task (hf engine, TP=1), said so;
and prints marlaas/baseline wall and async/sequential. --tool-workload adds a workload shaped like agentic
search (lookup tasks whose tool waits `tool_latency_s` on a service, next to single-turn addition tasks) and
prints its async/sequential. Figures depend on the machine's load: compare ratios from one run.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TRL_VENV = Path.home() / ".cache" / "marlaas_hpc" / "trl-venv"


# ---- the baseline's view of a task ----------------------------------------------------------------------
def task_payload(spec, model_path, output_dir, seed: int = 0) -> dict:
    """Everything the baseline needs to train `spec` as marlaas would: the exact prompt stream (B prompts per
    step, in the task's order), answers, the eval split, LoRA and GRPO hyper-parameters. Single-turn tasks
    whose reward is the exact match of synthetic tasks only (the baseline's verifier)."""
    from dataclasses import asdict

    from marlaas_hpc.env import build_task_data
    from marlaas_hpc.tasks.synthetic import SyntheticTask

    data = build_task_data(spec.dataset, spec.prompt.format)
    if type(data) is not SyntheticTask or spec.prompt.format != "raw":
        raise ValueError(f"task {spec.task_id}: the baseline covers raw-prompt synthetic tasks, not "
                         f"{spec.dataset.kind!r} ({spec.prompt.format} prompts)")
    algo = spec.algo
    if algo.loss not in ("grpo", "dapo") or algo.filters_groups or algo.overlong or algo.tis_cap:
        raise ValueError(f"task {spec.task_id}: the baseline covers the token-level loss without dynamic sampling, "
                         f"overlong shaping or TIS (TRL's loss_type 'dapo'), not {algo.loss!r} with those")
    train = [data.train_sample(i) for i in range(spec.total_steps * algo.batch_prompts)]
    evals = data.eval_samples()
    return {"task_id": spec.task_id, "model_path": str(model_path), "output_dir": str(output_dir), "seed": seed,
            "steps": spec.total_steps, "spec": spec.to_dict(),
            "algo": {**asdict(algo), "clip_eps": algo.clip_low, "clip_eps_high": algo.clip_high,  # resolved
                     "normalize_adv_std": algo.std_normalized}, "lora": {**asdict(spec.lora), "target_modules": list(spec.lora.target_modules)},
            "train_prompts": [s.prompt for s in train], "train_answers": [s.answer for s in train],
            "eval_prompts": [s.prompt for s in evals], "eval_answers": [s.answer for s in evals]}


def run_timed(command: list[str], env: dict | None = None, log: Path | None = None) -> tuple[float, float]:
    """(launch time, wall seconds) of a whole process; its output goes to `log`. A failure stops the benchmark."""
    t0 = time.time()
    with open(log or os.devnull, "w") as sink:
        proc = subprocess.run(command, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT)
    wall = time.time() - t0
    if proc.returncode != 0:
        tail = log.read_text()[-3000:] if log else ""
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(command)}\n{tail}")
    return t0, wall


def _env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONPATH=str(ROOT))


def baseline_task(kind: str, payload: dict, out: Path, trl_venv: Path) -> dict:
    """One task in a process of its own; its result JSON plus the process's wall."""
    out.mkdir(parents=True, exist_ok=True)
    payload_path, result_path = out / "payload.json", out / "result.json"
    payload_path.write_text(json.dumps(payload))
    if kind == "trl":
        command = [str(trl_venv / "bin" / "python"), str(ROOT / "tools" / "trl_baseline.py"), str(payload_path),
                   str(result_path)]
    else:
        command = [sys.executable, str(Path(__file__).resolve()), "--local-task", str(payload_path), str(result_path)]
    _, wall = run_timed(command, _env(), out / "log.txt")
    return {**json.loads(result_path.read_text()), "wall_s": wall}


def local_task(payload_path: str, result_path: str) -> None:
    """The LocalDriver baseline of one task (this process): hf engine, TP=1 trainer, eval before and after."""
    start = time.perf_counter()
    payload = json.loads(Path(payload_path).read_text())
    from marlaas_hpc.model import TextCodec
    from marlaas_hpc.rollout import make_engine
    from marlaas_hpc.tasks import TaskSpec
    from marlaas_hpc.trainer.trainer import MultiLoraTrainer, TrainerConfig

    sys.path.insert(0, str(ROOT / "tests"))  # tests/support/
    from support.local_driver import LocalDriver

    imported = time.perf_counter()
    codec = TextCodec.from_pretrained(payload["model_path"])
    trainer = MultiLoraTrainer(TrainerConfig(model_path=payload["model_path"], seed=payload["seed"]))
    engine = make_engine("hf", payload["model_path"], seed=payload["seed"])
    driver = LocalDriver(engine, trainer, codec, payload["output_dir"], seed=payload["seed"], log=lambda *_: None)
    spec = TaskSpec.from_dict(payload["spec"])
    driver.add_task(spec)
    set_up = time.perf_counter()
    result = driver.run()[spec.task_id]
    done = time.perf_counter()
    Path(result_path).write_text(json.dumps({
        "task_id": spec.task_id, "eval_before": result["eval_before"], "eval_after": result["eval_after"],
        "steps": result["version"], "import_s": imported - start, "setup_s": set_up - imported,
        "train_s": done - set_up, "process_s": done - start}))


def run_baseline(job, kind: str, out: Path, trl_venv: Path) -> dict:
    results = [baseline_task(kind, task_payload(spec, job.model_path(), out / spec.task_id / "work", job.seed),
                             out / spec.task_id, trl_venv) for spec in job.tasks]
    return {"kind": kind, "tasks": results, "wall_s": sum(r["wall_s"] for r in results),
            "train_s": sum(r["train_s"] for r in results),
            "gain": statistics.mean(r["eval_after"] - r["eval_before"] for r in results)}


# ---- marlaas ---------------------------------------------------------------------------------------------
def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def run_marlaas(config: Path, mode: str, out: Path) -> dict:
    """One `marlaas run` as a whole process; figures from its summary.json."""
    run_dir = out / "run"
    if run_dir.exists():
        import shutil

        shutil.rmtree(run_dir)
    out.mkdir(parents=True, exist_ok=True)
    launched, wall = run_timed([sys.executable, "-m", "marlaas_hpc.cli", "run", str(config), "--run-dir",
                                str(run_dir), "--mode", mode], _env(), out / "log.txt")
    summary = json.loads((run_dir / "summary.json").read_text())
    tasks = summary["tasks"].values()
    gains = [t["eval_accuracy_after"] - t["eval_accuracy_before"] for t in tasks
             if t["eval_accuracy_after"] is not None and t["eval_accuracy_before"] is not None]
    return {"mode": mode, "wall_s": wall, "ready_s": summary["job_start"] - launched,
            "train_s": summary["wall_time_s"], "run_dir_mb": dir_bytes(run_dir) / 1e6,
            "gain": statistics.mean(gains) if gains else float("nan"),
            "busy": summary.get("busy_fraction", {}), "summary": summary}


def gain_noise(row: dict, base: dict, job) -> float:
    """Standard error of (marlaas mean eval gain - baseline mean eval gain): both start from the same greedy
    accuracy, so only the after-accuracies differ, each a binomial over the task's eval prompts."""
    sizes = {spec.task_id: spec.dataset.eval_size for spec in job.tasks}
    ours = {task_id: t["eval_accuracy_after"] for task_id, t in row["summary"]["tasks"].items()}
    variance = 0.0
    for r in base["tasks"]:
        for p in (ours[r["task_id"]], r["eval_after"]):
            variance += p * (1 - p) / sizes[r["task_id"]]
    return variance ** 0.5 / len(base["tasks"])


def warm_up(kind: str, trl_venv: Path) -> None:
    """Untimed imports of each side's heavy packages first: the first process to read a venv from a cold page
    cache paid up to 20 s more for its imports (TRL's first task: 23 s against 4 s for the next three)."""
    commands = [[sys.executable, "-c", "import vllm, megatron.core, mbridge, transformers, peft"]]
    if kind == "trl":
        commands.append([str(trl_venv / "bin" / "python"), "-c", "import trl, peft, transformers, datasets"])
    for command in commands:
        subprocess.run(command, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)


# ---- printing --------------------------------------------------------------------------------------------
def print_marlaas(row: dict) -> None:
    busy = " ".join(f"{k} {v:.2f}" for k, v in row["busy"].items())
    print(f"  marlaas {row['mode']:<10} wall {row['wall_s']:6.1f} s = ready {row['ready_s']:5.1f} s + training "
          f"{row['train_s']:5.1f} s + exit {row['wall_s'] - row['ready_s'] - row['train_s']:4.1f} s; run dir "
          f"{row['run_dir_mb']:6.1f} MB; mean eval gain {row['gain']:+.3f}; busy {busy}", flush=True)


def print_baseline(base: dict) -> None:
    name = "TRL GRPOTrainer+PEFT" if base["kind"] == "trl" else "LocalDriver (TRL not installed)"
    for r in base["tasks"]:
        print(f"  {name} {r['task_id']:<8} wall {r['wall_s']:5.1f} s (imports {r['import_s']:4.1f}, set-up "
              f"{r['setup_s']:4.1f}, training {r['train_s']:5.1f}); eval {r['eval_before']:.3f} -> "
              f"{r['eval_after']:.3f}", flush=True)
    print(f"  {name} all tasks, one by one: wall {base['wall_s']:.1f} s (training {base['train_s']:.1f} s); mean "
          f"eval gain {base['gain']:+.3f}", flush=True)


def main() -> None:
    from marlaas_hpc.scheduler import MODES

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(ROOT / "configs" / "local-demo.yaml"))
    parser.add_argument("--modes", nargs="+", default=["async", "sequential"], choices=MODES)
    parser.add_argument("--baseline", default="auto", choices=["auto", "trl", "local", "none"],
                        help="auto: TRL if its venv exists, else LocalDriver per task")
    parser.add_argument("--trl-venv", default=str(DEFAULT_TRL_VENV))
    parser.add_argument("--tool-workload", action="store_true", help="also the agentic-search-shaped workload")
    parser.add_argument("--tool-steps", type=int, default=10)
    parser.add_argument("--tool-latency", type=float, default=1.0)
    parser.add_argument("--out", default=str(ROOT / "runs" / "bench_vs_trl"))
    parser.add_argument("--local-task", nargs=2, metavar=("PAYLOAD", "RESULT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.local_task:
        return local_task(*args.local_task)
    from marlaas_hpc.runtime.process import load_job

    out, config = Path(args.out).resolve(), Path(args.config).resolve()
    job = load_job(str(config), None, None)
    job.model_path()  # builds the tiny model once, outside every timed process
    trl_venv = Path(args.trl_venv)
    kind = args.baseline
    if kind == "auto":
        kind = "trl" if (trl_venv / "bin" / "python").exists() else "local"
        if kind == "local":
            print(f"[bench] no TRL venv at {trl_venv} (bash tools/setup_trl_venv.sh): baseline = the project's "
                  "LocalDriver per task", flush=True)
    warm_up(kind, trl_venv)
    print(f"[bench] workload {config.name}: {len(job.tasks)} tasks, "
          f"{' '.join(f'{t.task_id}x{t.total_steps}' for t in job.tasks)}", flush=True)
    rows = {}
    for mode in args.modes:
        rows[mode] = run_marlaas(config, mode, out / mode)
        print_marlaas(rows[mode])
    base = None
    if kind != "none":
        base = run_baseline(job, kind, out / f"baseline-{kind}", trl_venv)
        print_baseline(base)
    print("[bench] ratios (this run):", flush=True)
    if base is not None and "async" in rows:
        print(f"  marlaas async / {base['kind']} one-by-one wall = {rows['async']['wall_s'] / base['wall_s']:.2f} "
              f"(eval gain {rows['async']['gain']:+.3f} vs {base['gain']:+.3f}: difference "
              f"{rows['async']['gain'] - base['gain']:+.3f}, standard error {gain_noise(rows['async'], base, job):.3f})",
              flush=True)
    if "async" in rows and "sequential" in rows:
        print(f"  async / sequential: process wall {rows['async']['wall_s'] / rows['sequential']['wall_s']:.2f}, "
              f"training {rows['async']['train_s'] / rows['sequential']['train_s']:.2f}", flush=True)
    if args.tool_workload:
        import yaml

        from bench_modes import tool_workload  # tools/ is this script's directory: on sys.path

        tool_config = out / "tool-workload.yaml"
        tool_config.parent.mkdir(parents=True, exist_ok=True)
        tool_config.write_text(yaml.safe_dump(tool_workload(args.tool_steps, [args.tool_latency])))
        tool = {mode: run_marlaas(tool_config, mode, out / f"tool-{mode}") for mode in ("async", "sequential")}
        for row in tool.values():
            print_marlaas(row)
        print(f"  tool workload (lookup tool {args.tool_latency:g} s) async / sequential: training "
              f"{tool['async']['train_s'] / tool['sequential']['train_s']:.2f}, process wall "
              f"{tool['async']['wall_s'] / tool['sequential']['wall_s']:.2f}", flush=True)
    (out / "results.json").write_text(json.dumps({"marlaas": {m: {k: v for k, v in r.items() if k != "summary"}
                                                              for m, r in rows.items()}, "baseline": base},
                                                 indent=1))


if __name__ == "__main__":
    main()
