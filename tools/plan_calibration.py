"""`marlaas plan`'s trainer estimate against a CPU run's peak RSS: one fused step of the trainer on the CPU, laid out
as the dry run lays out its micro-batch (rows of --row-tokens, one sequence each), after every task has stepped
once. Prints one JSON line: the process's RSS before the model exists (baseline), the step's peak RSS (the
high-water mark restarted after the load and the first steps), and baseline + the estimate (float32 weights,
dense attention: the CPU twin's path).

    python tools/plan_calibration.py [--model tiny] [--micro-batch-tokens 8192] [--row-tokens 48] ...
"""
from __future__ import annotations

import argparse
import json
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", help="tiny, random:<shape> or a checkpoint dir")
    parser.add_argument("--micro-batch-tokens", type=int, default=8192)
    parser.add_argument("--row-tokens", type=int, default=48)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--max-adapters", type=int, default=8)
    parser.add_argument("--fused-tasks", type=int, default=4)
    args = parser.parse_args(argv)
    print(json.dumps(measure(args)))
    return 0


def measure(args) -> dict:
    from marlaas_hpc.config import JobConfig
    import host_memory  # tools/host_memory.py: this script's directory is on sys.path
    from marlaas_hpc.plan.command import model_dims
    from marlaas_hpc.plan.dry_run import DryRunShape, add_tasks, step_batches
    from marlaas_hpc.plan.estimate import TrainerInputs, trainer_memory
    from marlaas_hpc.trainer.trainer import MultiLoraTrainer, TrainerConfig

    job = JobConfig(model=args.model)
    model_path = job.model_path()
    shape = DryRunShape(model_dir=str(model_path), micro_batch_tokens=args.micro_batch_tokens,
                        row_tokens=args.row_tokens, prompt_tokens=args.prompt_tokens, lora_rank=args.lora_rank,
                        max_adapters=args.max_adapters, fused_tasks=args.fused_tasks, dtype="float32",
                        attention="dense")
    import mbridge.models.qwen3  # noqa: F401  what the trainer imports on its way to a model: in the baseline
    import megatron.core.models.gpt.gpt_model  # noqa: F401
    import megatron.core.parallel_state  # noqa: F401
    import transformers  # noqa: F401

    baseline = host_memory.rss_bytes()
    trainer = MultiLoraTrainer(TrainerConfig(model_path=str(model_path), micro_batch_tokens=shape.micro_batch_tokens,
                                             device="cpu", dtype="float32", attention="dense"))
    task_ids = add_tasks(trainer, shape)
    for first in range(0, len(task_ids), shape.tasks_per_step):  # every task holds its optimizer state
        trainer.train_steps(step_batches(task_ids[first:first + shape.tasks_per_step], shape))
    host_memory.reset_peak()
    trainer.train_steps(step_batches(task_ids[:shape.tasks_per_step], shape))
    inputs = TrainerInputs(dims=model_dims(job)[0], tensor_parallel=1, dtype_bytes=4,
                           micro_batch_tokens=shape.micro_batch_tokens, row_tokens=shape.row_tokens,
                           prompt_tokens=shape.prompt_tokens, lora_rank=shape.lora_rank,
                           max_adapters=shape.max_adapters, fused_tasks=shape.fused_tasks, recompute=False,
                           attention="dense")
    memory = trainer_memory(inputs)
    return {"model": args.model, "baseline_bytes": baseline, "step_peak_rss_bytes": host_memory.peak_rss_bytes(),
            "estimate_bytes": baseline + memory.total, "plan_bytes": memory.total, "tokens": inputs.tokens,
            "rows": inputs.rows}


if __name__ == "__main__":
    sys.exit(main())
