"""One trainer step and one rollout batch at the full Qwen3-0.6B shape (random weights, built locally), on this
machine: tokens/s of each and the peak RSS of each process. Prints figures; asserts nothing about speed.

    python tools/bench_real.py [--shape qwen3-0.6b] [--prompts 4] [--group 4] [--prompt-tokens 64]
                               [--new-tokens 64] [--lora-rank 32] [--tp 1] [--device cpu|cuda]
                               [--engine vllm|hf] [--steps 1] [--no-rollout] [--json PATH]

The checkpoint (28 layers, 151,936-word vocabulary, tied embeddings, ~0.6B parameters, 2.4 GB in fp32) is built
once into the cache (`model: random:qwen3-0.6b`). Each part runs in a process of its own, so each peak RSS is
that part's alone: first the trainer (megatron-core, fp32 on CPU; one GRPO step of one LoRA task over
prompts x group rows, which also exports the adapter), then the rollout (vLLM in-process engine with that
adapter, prompts x group sequences of --new-tokens, temperature 1).

Each part also prints `marlaas plan`'s estimate next to its peak RSS (marlaas_hpc/plan): the process's RSS before
the model exists (its baseline: Python, torch, megatron-core, transformers or vLLM imported) plus the estimate for
the CPU path (float32 weights, dense attention, vLLM's fixed CPU KV cache), against the high-water mark restarted
once the model is loaded (mbridge and vLLM read the safetensors through mmap: the file's pages count in RSS while
the weights are copied, a transient the estimate leaves out). The children run with glibc's mmap threshold fixed at
its default (MALLOC_MMAP_THRESHOLD_): otherwise glibc raises it as large blocks are freed and keeps freed tensors'
memory in the heap, and RSS no longer follows the live tensors.

`--device cuda` runs both parts on the GPU instead (one GPU, --tp 1): the trainer in bf16 with the attention it
picks on CUDA (FlexAttention), the rollout engine in bf16, and the figures are torch's CUDA allocator peaks
(max_memory_allocated: the CUDA context and the allocator's cache left out, as in the plan) against `marlaas plan`'s
GPU estimate of the same step, and max_memory_reserved (the allocator's cache and fragmentation included) against
the same estimate. `--steps N` times the last of N steps (the first compiles FlexAttention's kernels).
`--engine hf` generates with transformers + PEFT where vLLM is not installed.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


def _rows(args) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, completion ids) rows drawn from the tokenizer's ordinary tokens, seeded."""
    import random

    rng = random.Random(0)
    return [([rng.randrange(300, 4000) for _ in range(args.prompt_tokens)],
             [rng.randrange(300, 4000) for _ in range(args.new_tokens)]) for _ in range(args.prompts * args.group)]


def trainer_part(args, model_path: str, out_dir: str) -> dict:
    from marlaas_hpc.trajectory import assign_advantages
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # tests/support/
    from support.local_group import run_local
    from marlaas_hpc.trajectory import Trajectory

    trajectories = [Trajectory("bench", f"g{i // args.group}", p, c, [-11.9] * len(c), 0, reward=float(i % 2))
                    for i, (p, c) in enumerate(_rows(args))]
    assign_advantages(trajectories)
    threads = max(1, (os.cpu_count() or 1) // args.tp)
    records = run_local(_train, args.tp, model_path, args.tp, trajectories, args.lora_rank, out_dir,
                        args.device, args.steps, timeout=3600, threads=threads,
                        backend="nccl" if args.device == "cuda" else "gloo")
    return records[0]


def _train(rank: int, model_path: str, tp: int, trajectories, lora_rank: int, out_dir: str, device: str,
           steps: int) -> dict:
    import mbridge.models.qwen3  # noqa: F401  (what the trainer imports on its way to a model: in the baseline)
    import megatron.core.models.gpt.gpt_model  # noqa: F401

    import host_memory  # tools/host_memory.py: this script's directory is on sys.path
    from marlaas_hpc.tasks.spec import AlgoSpec, LoraSpec
    from marlaas_hpc.trainer.trainer import MultiLoraTrainer, TrainerConfig

    start = time.perf_counter()
    baseline = host_memory.rss_bytes()
    cuda = device == "cuda"
    trainer = MultiLoraTrainer(TrainerConfig(model_path=model_path, tensor_parallel=tp, device=device,
                                             dtype="bfloat16" if cuda else "auto"))
    trainer.add_task("bench", LoraSpec(rank=lora_rank, alpha=2.0 * lora_rank), AlgoSpec(lr=1e-5))
    built = time.perf_counter()
    load_rss = _peak_rss_gib()
    host_memory.reset_peak()
    gpu = _CudaPeaks() if cuda else None
    for _ in range(steps):  # the last one is timed: the first compiles FlexAttention's kernels on CUDA
        step_start = time.perf_counter()
        metrics = trainer.train_step("bench", trajectories)
        if cuda:
            gpu.synchronize()
    step_peak = host_memory.peak_rss_bytes()
    stepped = time.perf_counter()
    export = trainer.export_adapter("bench", Path(out_dir) / "adapter")
    tokens = sum(len(t.prompt_ids) + len(t.completion_ids) for t in trajectories)
    gpu_figures = {} if gpu is None else {
        "gpu_load_gib": gpu.load / 2**30, "gpu_peak_gib": gpu.peak() / 2**30,
        "gpu_reserved_gib": gpu.reserved() / 2**30,
        "gpu_estimate_gib": _trainer_estimate(model_path, tp, trajectories, lora_rank, dtype_bytes=2,
                                              attention="flex") / 2**30,
        "gpu_name": gpu.name}
    return {**gpu_figures, "load_s": built - start, "step_s": stepped - step_start, "tokens": tokens,
            "tokens_per_s": tokens / (stepped - step_start), "loss": metrics["loss"], "adapter": str(export),
            "peak_rss_gib": max(load_rss, step_peak / 2**30),  # reset_peak restarted the kernel's own
            "load_peak_rss_gib": load_rss, "baseline_gib": baseline / 2**30,
            "step_peak_rss_gib": step_peak / 2**30,
            "estimate_gib": (baseline + _trainer_estimate(model_path, tp, trajectories, lora_rank)) / 2**30,
            "params": sum(p.numel() for p in trainer.model.parameters())}


class _CudaPeaks:
    """torch's CUDA allocator figures of this process: what the loaded model holds, the peak since."""

    def __init__(self):
        import torch

        torch.cuda.synchronize()
        self.torch = torch
        self.name = torch.cuda.get_device_name()
        self.load = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()

    def synchronize(self) -> None:
        self.torch.cuda.synchronize()

    def peak(self) -> int:
        return self.torch.cuda.max_memory_allocated()

    def reserved(self) -> int:
        """What the caching allocator held at most: allocated plus its cache and fragmentation."""
        return self.torch.cuda.max_memory_reserved()


def _trainer_estimate(model_path: str, tp: int, trajectories, lora_rank: int, dtype_bytes: int = 4,
                      attention: str = "dense") -> int:
    """`marlaas plan`'s trainer estimate of this step (fp32 dense on the CPU; bf16 flex on CUDA): one pass over
    rows of one sequence each."""
    from marlaas_hpc.model.shape import ModelShape
    from marlaas_hpc.plan.estimate import TrainerInputs, trainer_memory

    width = max(len(t.prompt_ids) + len(t.completion_ids) for t in trajectories)
    inputs = TrainerInputs(dims=ModelShape.read(model_path), tensor_parallel=tp, dtype_bytes=dtype_bytes,
                           micro_batch_tokens=len(trajectories) * width, row_tokens=width,
                           prompt_tokens=len(trajectories[0].prompt_ids), lora_rank=lora_rank, max_adapters=1,
                           fused_tasks=1, recompute=False, attention=attention)
    return trainer_memory(inputs).total


def rollout_part(args, model_path: str, adapter: str, work_dir: str) -> dict:
    if args.engine == "vllm":
        import vllm  # noqa: F401  (in the baseline)

    import host_memory  # tools/host_memory.py: this script's directory is on sys.path
    from marlaas_hpc.rollout import AdapterRef, GenerationRequest, make_engine
    from marlaas_hpc.rollout import vllm_engine  # noqa: F401

    start = time.perf_counter()
    baseline = host_memory.rss_bytes()
    max_model_len = args.prompt_tokens + args.new_tokens + 8
    if args.engine == "hf":
        import torch

        dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
        engine = make_engine("hf", model_path, device=args.device, dtype=dtype, seed=0)
    else:
        dtype_kw = {"dtype": "bfloat16"} if args.device == "cuda" else {}
        engine = make_engine("vllm", model_path, work_dir=work_dir, max_loras=1, max_lora_rank=args.lora_rank,
                             max_model_len=max_model_len, seed=0, **dtype_kw)
    engine.add_adapter(AdapterRef("bench", 1, adapter))
    gpu = _CudaPeaks() if args.device == "cuda" else None
    ready = time.perf_counter()
    start_peak = host_memory.peak_rss_bytes()
    host_memory.reset_peak()
    requests = [GenerationRequest(f"r{i}", "bench", 1, prompt, temperature=1.0, max_new_tokens=args.new_tokens,
                                  seed=i) for i, (prompt, _) in enumerate(_rows(args))]
    gens = engine.generate(requests)
    if gpu is not None:
        gpu.synchronize()
    done = time.perf_counter()
    gpu_figures = {} if gpu is None else {"gpu_load_gib": gpu.load / 2**30, "gpu_peak_gib": gpu.peak() / 2**30}
    engine.close()
    generated = sum(len(g.completion_ids) for g in gens)
    return {**gpu_figures, "start_s": ready - start, "batch_s": done - ready, "sequences": len(gens),
            "generated_tokens": generated,
            "tokens_per_s": generated / (done - ready),
            "peak_rss_gib": max(start_peak, host_memory.peak_rss_bytes()) / 2**30,
            "baseline_gib": baseline / 2**30, "start_peak_rss_gib": start_peak / 2**30,
            "batch_peak_rss_gib": host_memory.peak_rss_bytes() / 2**30,
            "estimate_gib": (baseline + _rollout_estimate(model_path, args, max_model_len)) / 2**30
            if args.engine == "vllm" else 0.0}


def _rollout_estimate(model_path: str, args, max_model_len: int) -> int:
    """`marlaas plan`'s rollout figures on the CPU: float32 weights, one LoRA slot, vLLM's fixed CPU KV cache
    (the engine's default 1 GiB), the profiling forward's estimate."""
    from marlaas_hpc.plan.command import VLLM_MAX_NUM_SEQS
    from marlaas_hpc.model.shape import ModelShape
    from marlaas_hpc.plan.estimate import RolloutInputs, rollout_memory

    memory = rollout_memory(RolloutInputs(dims=ModelShape.read(model_path), tensor_parallel=1, dtype_bytes=4,
                                          gpu_bytes=0, gpu_memory_utilization=1.0, max_loras=1,
                                          max_lora_rank=args.lora_rank, max_model_len=max_model_len,
                                          max_num_seqs=VLLM_MAX_NUM_SEQS))
    return memory.weights + memory.lora_slots + memory.activations + 2**30


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen3-0.6b")
    parser.add_argument("--prompts", type=int, default=4, help="prompt groups (B)")
    parser.add_argument("--group", type=int, default=4, help="samples per prompt (G)")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--lora-rank", type=int, default=32)
    parser.add_argument("--tp", type=int, default=1, help="trainer tensor parallelism (gloo processes)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where both parts run")
    parser.add_argument("--engine", choices=["vllm", "hf"], default="vllm", help="rollout engine")
    parser.add_argument("--steps", type=int, default=1, help="trainer steps; the last is timed")
    parser.add_argument("--no-rollout", action="store_true", help="the trainer part only")
    parser.add_argument("--json", type=Path, help="write the trainer's (and rollout's) figures there too")
    parser.add_argument("--part", choices=["trainer", "rollout"], help=argparse.SUPPRESS)
    parser.add_argument("--model-path", help=argparse.SUPPRESS)
    parser.add_argument("--adapter", help=argparse.SUPPRESS)
    parser.add_argument("--work-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))  # the rollout engine uses every core
    if args.part == "trainer":
        print(json.dumps(trainer_part(args, args.model_path, args.work_dir)))
        return 0
    if args.part == "rollout":
        print(json.dumps(rollout_part(args, args.model_path, args.adapter, args.work_dir)))
        return 0

    from marlaas_hpc.model.random_checkpoints import SHAPES, ensure_random_checkpoint

    start = time.perf_counter()
    model_path = str(ensure_random_checkpoint(args.shape))
    print(f"[bench_real] checkpoint {args.shape} ({SHAPES[args.shape]}) at {model_path} "
          f"({time.perf_counter() - start:.0f} s)", flush=True)
    common = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in
              ("shape", "prompts", "group", "prompt_tokens", "new_tokens", "lora_rank", "tp", "device", "engine",
               "steps")]
    with tempfile.TemporaryDirectory() as work:
        trainer = _child(common + ["--part=trainer", f"--model-path={model_path}", f"--work-dir={work}"])
        rollout = None if args.no_rollout else _child(common + [
            "--part=rollout", f"--model-path={model_path}", f"--adapter={trainer['adapter']}",
            f"--work-dir={work}/vllm"])
    rows = args.prompts * args.group
    if args.json:
        args.json.write_text(json.dumps({"shape": args.shape, "device": args.device, "rows": rows,
                                         "lora_rank": args.lora_rank, **trainer,
                                         **({} if rollout is None else {"rollout": rollout})}, indent=1))
    if args.device == "cuda":
        return _print_gpu(args, trainer, rollout, rows)
    print(f"[bench_real] {args.shape}: {trainer['params'] / 1e6:.0f}M parameters (this TP rank), "
          f"{os.cpu_count()} CPU cores, all of them used by each part")
    print(f"trainer  TP={args.tp} fp32, LoRA r{args.lora_rank}, {rows} rows x {args.prompt_tokens}+{args.new_tokens} "
          f"tokens: step {trainer['step_s']:.1f} s = {trainer['tokens_per_s']:.0f} tokens/s "
          f"(load {trainer['load_s']:.1f} s), peak RSS {trainer['peak_rss_gib']:.2f} GiB "
          f"({trainer['load_peak_rss_gib']:.2f} GiB after loading)")
    print(f"         step peak RSS {trainer['step_peak_rss_gib']:.2f} GiB; marlaas plan: baseline "
          f"{trainer['baseline_gib']:.2f} + estimate = {trainer['estimate_gib']:.2f} GiB "
          f"({trainer['estimate_gib'] / trainer['step_peak_rss_gib'] - 1:+.0%})")
    if rollout is None:
        return 0
    print(f"rollout  {args.engine} fp32, LoRA r{args.lora_rank}, {rollout['sequences']} sequences x {args.new_tokens} new tokens: "
          f"batch {rollout['batch_s']:.1f} s = {rollout['tokens_per_s']:.1f} generated tokens/s "
          f"(engine start {rollout['start_s']:.1f} s), peak RSS {rollout['peak_rss_gib']:.2f} GiB")
    if args.engine != "vllm":  # the plan sizes vLLM's engine only
        return 0
    print(f"         batch peak RSS {rollout['batch_peak_rss_gib']:.2f} GiB (engine start "
          f"{rollout['start_peak_rss_gib']:.2f}); marlaas plan: baseline {rollout['baseline_gib']:.2f} + estimate = "
          f"{rollout['estimate_gib']:.2f} GiB ({rollout['estimate_gib'] / rollout['batch_peak_rss_gib'] - 1:+.0%})")
    return 0


def _print_gpu(args, trainer: dict, rollout: dict | None, rows: int) -> int:
    print(f"[bench_real] {args.shape} on {trainer['gpu_name']}: {trainer['params'] / 1e6:.0f}M parameters")
    print(f"trainer  bf16 flex, LoRA r{args.lora_rank}, {rows} rows x {args.prompt_tokens}+{args.new_tokens} tokens: "
          f"step {trainer['step_s']:.2f} s = {trainer['tokens_per_s']:.0f} tokens/s (step {args.steps} of "
          f"{args.steps}; load {trainer['load_s']:.1f} s)")
    print(f"         GPU allocated: {trainer['gpu_load_gib']:.2f} GiB loaded, peak {trainer['gpu_peak_gib']:.2f} GiB; "
          f"marlaas plan {trainer['gpu_estimate_gib']:.2f} GiB "
          f"({trainer['gpu_estimate_gib'] / trainer['gpu_peak_gib'] - 1:+.1%}); CUDA max_memory_reserved "
          f"{trainer['gpu_reserved_gib']:.2f} GiB "
          f"({trainer['gpu_estimate_gib'] / trainer['gpu_reserved_gib'] - 1:+.1%})")
    if rollout is None:
        return 0
    print(f"rollout  {args.engine} bf16, LoRA r{args.lora_rank}, {rollout['sequences']} sequences x "
          f"{args.new_tokens} new tokens: batch {rollout['batch_s']:.2f} s = {rollout['tokens_per_s']:.0f} generated "
          f"tokens/s (engine start {rollout['start_s']:.1f} s); GPU allocated {rollout['gpu_load_gib']:.2f} GiB "
          f"loaded, peak {rollout['gpu_peak_gib']:.2f} GiB")
    return 0


def _child(argv: list[str]) -> dict:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": os.environ.get("MALLOC_MMAP_THRESHOLD_", "131072")}
    proc = subprocess.run([sys.executable, __file__, *argv], capture_output=True, text=True, env=env)
    if proc.returncode:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"[bench_real] {' '.join(argv)} failed with exit status {proc.returncode}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    sys.exit(main())
