"""The GPU dry run: one trainer rank's GPU path, run for real on fake CUDA tensors (fake_cuda.py), counting the
device memory it would hold.

    python -m marlaas_hpc.plan.dry_run --model-dir DIR [--tensor-parallel 2] [--micro-batch-tokens 16384] ...

It runs the trainer's own code (MultiLoraTrainer, build_gpt_model, MultiLora, packing, GRPO) with
`load_weights=False` (DIR needs config.json only) in bfloat16 on device 'cuda': the model build, `max_adapters`
tasks' adapters, then fused multi-task steps (forward, backward, AdamW) of `fused_tasks` tasks each until every
task has stepped once (so the last step runs with every other task's gradients and AdamW moments live, as in a
long job), then the delta flatten of one task's adapter (`adapter_tensors` + runtime/delta/broadcast.py `flat_buffer`).
Each step is one micro-batch of exactly `micro_batch_tokens`: rows of `row_tokens` tokens, one sequence each (a
prompt of `prompt_tokens` and its completion) with an advantage of +-1 (every row trains). Other TP ranks are a fake process group (`init_process_group("fake")`: collectives return at
once); TP ranks are SPMD, so one rank's figures are every rank's (the simulated one is the last: it also holds
megatron's vocabulary padding).

A CPU tensor meeting a CUDA one anywhere on this path raises FakeTensorDeviceMismatchError: the run fails, which
is the point. Values are not computed: host reads of device scalars return 1 (counted as `host_syncs`).

The shim must load before torch: run this module in a process of its own (`run_in_subprocess`).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator

from marlaas_hpc.plan import fake_cuda


@dataclass(frozen=True, kw_only=True)
class DryRunShape:
    """What one dry run simulates."""

    model_dir: str
    """A directory holding the model's config.json (weights, if any, are not read)."""
    tensor_parallel: int = 1
    """TP size of the trainer group (the fake process group's world)."""
    micro_batch_tokens: int = 16384
    """Tokens of the step's one micro-batch (rows x row_tokens)."""
    row_tokens: int = 2048
    """Width of every packed row: one sequence of prompt_tokens + completion."""
    prompt_tokens: int = 32
    """Prompt of each sequence; the rest of the row is its completion (trained tokens)."""
    lora_rank: int = 32
    """Rank of every task's adapter (alpha = 2 x rank), on the seven projections."""
    max_adapters: int = 8
    """Tasks whose adapters and optimizer states are live."""
    fused_tasks: int = 4
    """Tasks fused into one step (trainer_slots)."""
    dtype: str = "bfloat16"
    """Base weights."""
    recompute: bool = False
    """trainer.recompute."""
    attention: str = "auto"
    """trainer.attention: 'auto' (= 'flex' on CUDA), 'flex' or 'dense'."""

    @property
    def rows(self) -> int:
        return max(1, self.micro_batch_tokens // self.row_tokens)

    @property
    def tasks_per_step(self) -> int:
        """Tasks of one fused step: fused_tasks, or fewer when there are fewer rows or tasks."""
        return min(self.fused_tasks, self.rows, self.max_adapters)

    def to_args(self) -> list[str]:
        return [f"--{name.replace('_', '-')}={value}" for name, value in asdict(self).items()]


@dataclass(kw_only=True)
class DryRunResult:
    """Device bytes of the simulated rank (fake CUDA storages) at each phase; `tp_rank` is the rank simulated."""

    shape: DryRunShape
    tp_rank: int
    base_bytes: int
    """After the model build: base weights (and megatron's buffers)."""
    adapters_bytes: int
    """Added by the max_adapters tasks' adapters (fp32 A and B)."""
    step_peak_bytes: int
    """Peak during the fused steps (the largest of them): everything live, activations, logits, gradients."""
    step_added_bytes: int
    """What the last step adds at its peak to what was live before it: activations, logits and the gradients
    back-propagated by then."""
    steady_bytes: int
    """Live after every task has stepped: weights, adapters, gradients and AdamW moments of every task (and what
    megatron keeps between steps)."""
    delta_peak_bytes: int
    """Peak above steady_bytes while one task's adapter is gathered and flattened for a delta broadcast."""
    host_syncs_per_step: int
    """Device-to-host reads of one fused step (each is a sync on a GPU)."""
    trained_tokens: int
    """Completion tokens of one step's micro-batch."""
    ops: int
    seconds: float
    step_peaks: list[int] = field(default_factory=list)

    @property
    def steady_peak_bytes(self) -> int:
        """A step's peak in a long job: what every task holds between steps plus what a step adds (the last step
        of the dry run is its tasks' first: their gradients and AdamW moments did not exist yet before it)."""
        return self.steady_bytes + self.step_added_bytes

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "shape": asdict(self.shape)})

    @classmethod
    def from_json(cls, text: str) -> "DryRunResult":
        data = json.loads(text)
        return cls(**{**data, "shape": DryRunShape(**data["shape"])})


def run(shape: DryRunShape, cache_dir: Path) -> DryRunResult:
    """Runs the dry run in this process (which must not have imported torch yet)."""
    fake_cuda.install(cache_dir)
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    start = time.perf_counter()
    tp_rank = shape.tensor_parallel - 1
    with fake_cuda.cuda_runtime(), _uncompiled_flex_attention(), fake_cuda.fake_gpu_mode(), \
            fake_cuda.memory_counter() as counter:
        dist.init_process_group("fake", store=FakeStore(), rank=tp_rank, world_size=shape.tensor_parallel)
        try:
            trainer = _trainer(shape)
            base = counter.live
            task_ids = add_tasks(trainer, shape)
            adapters = counter.live - base
            peaks, syncs, added = [], 0, 0
            for first in range(0, len(task_ids), shape.tasks_per_step):
                counter.reset_peak()
                before, live = counter.host_syncs, counter.live
                trainer.train_steps(step_batches(task_ids[first:first + shape.tasks_per_step], shape))
                peaks.append(counter.peak)
                syncs, added = counter.host_syncs - before, counter.peak - live
            steady = counter.live
            counter.reset_peak()
            _flatten_delta(trainer, task_ids[0])
            delta = counter.peak - steady
        finally:
            dist.destroy_process_group()
    return DryRunResult(shape=shape, tp_rank=tp_rank, base_bytes=base, adapters_bytes=adapters,
                        step_peak_bytes=max(peaks), step_added_bytes=added, steady_bytes=steady,
                        delta_peak_bytes=delta,
                        host_syncs_per_step=syncs, trained_tokens=shape.rows * _completion_tokens(shape),
                        ops=counter.ops, seconds=time.perf_counter() - start, step_peaks=peaks)


@contextmanager
def _uncompiled_flex_attention() -> Iterator[None]:
    """The one part of the GPU path the dry run replaces: on CUDA the trainer compiles FlexAttention into a Triton
    kernel (trainer/attention.py `flex_kernel`), which needs a GPU to build. Called uncompiled on fake tensors,
    flex_attention allocates what that kernel returns (the output and one float32 logsumexp per query and head)
    and saves the same tensors for backward; it materialises no score matrix (only its eager CPU/GPU kernels
    would)."""
    from torch.nn.attention import flex_attention as flex

    from marlaas_hpc.trainer import attention

    # eager flex_attention still wraps its operator in torch.compile (to give it autograd), which refuses a
    # dispatch mode like the dry run's; the operator has its own autograd rule, which this flag makes it use
    with fake_cuda.replaced(attention, "flex_kernel", lambda device_type: flex.flex_attention), \
            fake_cuda.replaced(flex, "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", True):
        yield


def _trainer(shape: DryRunShape):
    from marlaas_hpc.trainer.trainer import MultiLoraTrainer, TrainerConfig

    return MultiLoraTrainer(TrainerConfig(model_path=shape.model_dir, tensor_parallel=shape.tensor_parallel,
                                          micro_batch_tokens=shape.micro_batch_tokens, device="cuda",
                                          dtype=shape.dtype, recompute=shape.recompute, attention=shape.attention,
                                          load_weights=False))


def add_tasks(trainer, shape: DryRunShape) -> list[str]:
    from marlaas_hpc.tasks.spec import AlgoSpec, LoraSpec

    task_ids = [f"task{i}" for i in range(shape.max_adapters)]
    for task_id in task_ids:
        trainer.add_task(task_id, LoraSpec(rank=shape.lora_rank, alpha=2.0 * shape.lora_rank), AlgoSpec())
    return task_ids


def _completion_tokens(shape: DryRunShape) -> int:
    return min(shape.row_tokens, shape.micro_batch_tokens) - shape.prompt_tokens


def step_batches(task_ids: list[str], shape: DryRunShape) -> dict:
    """One micro-batch's rows shared out over the tasks, one sequence per row. Advantages are +-1 as the env ranks
    would set them for a group with different rewards (a zero advantage would skip the row: `_contributes`)."""
    from marlaas_hpc.trajectory import Trajectory

    rows, completion = shape.rows, _completion_tokens(shape)
    tasks = task_ids[:shape.tasks_per_step]
    batches: dict[str, list] = {task_id: [] for task_id in tasks}
    for row in range(rows):
        task_id = tasks[row * len(tasks) // rows]
        prompt = [3 + (row // 2 + i) % 90 for i in range(shape.prompt_tokens)]  # any ids below any vocabulary
        batches[task_id].append(Trajectory(task_id, f"{task_id}/g{row // 2}", prompt,
                                           [3 + (row + 7 * i) % 90 for i in range(completion)],
                                           [-1.0] * completion, 0, reward=float(row % 2),
                                           advantage=1.0 if row % 2 else -1.0))
    return batches


def _flatten_delta(trainer, task_id: str) -> None:
    """What TrainerRank._publish does on the leader before the broadcast: the whole adapter, TP-gathered, as the
    one flat float32 buffer a DeltaChannel sends (on the GPU under NCCL)."""
    import torch

    from marlaas_hpc.runtime.delta.plane import flat_buffer

    tensors = trainer.adapter_tensors(task_id)
    flat_buffer(tensors, sorted(tensors), torch.device("cuda", 0))


def run_in_subprocess(shape: DryRunShape, cache_dir: Path, timeout_s: float = 1800.0) -> DryRunResult:
    """`run` in a fresh Python process (the shim must load before torch); raises with the child's error."""
    command = [sys.executable, "-m", "marlaas_hpc.plan.dry_run", *shape.to_args(), f"--cache-dir={cache_dir}",
               "--json"]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode:
        raise RuntimeError(f"GPU dry run failed ({' '.join(command[3:])}):\n{proc.stderr[-6000:]}")
    return DryRunResult.from_json(proc.stdout.strip().splitlines()[-1])


def _parse(argv: list[str] | None) -> tuple[DryRunShape, Path, bool]:
    parser = argparse.ArgumentParser(prog="python -m marlaas_hpc.plan.dry_run", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = DryRunShape(model_dir="")
    for name, value in asdict(defaults).items():
        flag = f"--{name.replace('_', '-')}"
        if isinstance(value, bool):
            parser.add_argument(flag, type=lambda text: text.lower() in ("1", "true", "yes"), default=value)
        else:
            parser.add_argument(flag, type=type(value), default=value, required=name == "model_dir")
    parser.add_argument("--cache-dir", type=Path, default=None, help="where the compiled shim is kept")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON line")
    args = vars(parser.parse_args(argv))
    cache_dir, as_json = args.pop("cache_dir"), args.pop("json")
    if cache_dir is None:
        from marlaas_hpc.model.cache import default_cache_dir

        cache_dir = default_cache_dir()
    return DryRunShape(**args), cache_dir, as_json


def main(argv: list[str] | None = None) -> int:
    shape, cache_dir, as_json = _parse(argv)
    result = run(shape, cache_dir)
    if as_json:
        print(result.to_json())
        return 0
    gib = 2 ** 30
    print(f"dry run {shape.model_dir} TP={shape.tensor_parallel} (rank {result.tp_rank} simulated), {shape.dtype}, "
          f"micro-batch {shape.micro_batch_tokens} tokens ({shape.rows} rows x {shape.row_tokens}), "
          f"{result.trained_tokens} trained tokens, LoRA r{shape.lora_rank} x {shape.max_adapters} tasks, "
          f"{shape.fused_tasks} fused, recompute {shape.recompute}: {result.seconds:.1f} s, {result.ops} ops")
    for label, value in (("base weights", result.base_bytes), ("adapters", result.adapters_bytes),
                         ("steady (weights, adapters, grads, AdamW)", result.steady_bytes),
                         ("step peak (largest measured)", result.step_peak_bytes),
                         ("a step adds (last step)", result.step_added_bytes),
                         ("steady-state peak (steady + a step)", result.steady_peak_bytes),
                         ("delta flatten (above steady)", result.delta_peak_bytes)):
        print(f"  {label:<42} {value / gib:8.2f} GiB")
    print(f"  host syncs per step {result.host_syncs_per_step}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
