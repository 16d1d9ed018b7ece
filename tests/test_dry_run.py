"""The GPU dry run (marlaas_hpc/plan/dry_run.py): the trainer's GPU path on fake CUDA tensors of a CPU-only torch.
The shipped config's trainer rank runs without a device mismatch and measures what `marlaas plan` estimates; a CPU
tensor on the GPU path fails the run."""
import json
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from marlaas_hpc.config import JobConfig
from marlaas_hpc.plan.command import model_config_dir, model_dims, trainer_inputs
from marlaas_hpc.plan.dry_run import DryRunShape, run_in_subprocess
from marlaas_hpc.plan.estimate import lora_elements, trainer_memory

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                                reason="the dry run compiles its fake CUDA shim with a C++ compiler")


def shape_of(inputs, model_dir) -> DryRunShape:
    return DryRunShape(model_dir=str(model_dir), tensor_parallel=inputs.tensor_parallel,
                       micro_batch_tokens=inputs.micro_batch_tokens, row_tokens=inputs.row_tokens,
                       prompt_tokens=inputs.prompt_tokens, lora_rank=inputs.lora_rank,
                       max_adapters=inputs.max_adapters, fused_tasks=inputs.fused_tasks,
                       recompute=inputs.recompute, attention=inputs.attention)


def test_the_shipped_config_s_trainer_rank_runs_on_fake_cuda_as_plan_estimates(tmp_path):
    """configs/qwen3-0.6b-gsm8k.yaml (Qwen3-0.6B, TP=2, 16384-token micro-batches, bf16, LoRA r32, 8 adapters, 4
    fused): model build, every task's step, the delta flatten. No device mismatch; the estimate is the measure."""
    job = JobConfig.load(ROOT / "configs" / "qwen3-0.6b-gsm8k.yaml").validate()
    dims, _ = model_dims(job, "random:qwen3-0.6b")
    inputs = trainer_inputs(job, dims)
    result = run_in_subprocess(shape_of(inputs, model_config_dir("random:qwen3-0.6b")), tmp_path / "cache")
    memory = trainer_memory(inputs)
    assert result.tp_rank == 1 and len(result.step_peaks) == 2  # 8 tasks, 4 per step
    assert result.base_bytes == memory.base_weights
    assert result.adapters_bytes == inputs.max_adapters * memory.lora_per_task
    assert result.steady_bytes == pytest.approx(memory.steady, rel=1e-3)  # + the Adam moments and gradients
    assert result.step_added_bytes == pytest.approx(memory.activations + memory.logits, rel=0.02)
    assert result.steady_peak_bytes == pytest.approx(memory.step_peak, rel=0.02)
    # the flattened delta: one task's whole adapter in float32 (TP-gathered: its sharded halves twice over)
    assert lora_elements(dims, 2, 32) * 4 < result.delta_peak_bytes <= 2 * lora_elements(dims, 1, 32) * 4
    assert result.host_syncs_per_step > 0  # logged loss statistics read device scalars


@pytest.mark.parametrize("change", [{"recompute": True}, {"attention": "dense", "micro_batch_tokens": 4096},
                                    {"tensor_parallel": 1, "fused_tasks": 1}])
def test_the_estimate_follows_the_dry_run_on_other_paths(tmp_path, change):
    """Recompute, megatron's dense attention, TP=1 with one task per step: two layers of Qwen3-8B's width."""
    job = JobConfig.load(ROOT / "configs" / "qwen3-0.6b-gsm8k.yaml").validate()
    directory = tmp_path / "model"
    directory.mkdir()
    config = json.loads((model_config_dir("random:qwen3-8b") / "config.json").read_text())
    config.update(num_hidden_layers=2, max_window_layers=2, layer_types=config["layer_types"][:2])
    (directory / "config.json").write_text(json.dumps(config))
    dims, _ = model_dims(job, str(directory))
    job.trainer.micro_batch_tokens = 8192
    inputs = replace(trainer_inputs(job, dims), max_adapters=2, **change)
    result = run_in_subprocess(shape_of(inputs, directory), tmp_path / "cache")
    memory = trainer_memory(inputs)
    assert result.steady_peak_bytes == pytest.approx(memory.step_peak, rel=0.05), result


def test_a_cpu_tensor_on_the_gpu_path_fails_the_dry_run(tmp_path):
    """The bug the dry run is for: a tensor left on the host (here the packed batch's targets, as if
    PackedBatch.to forgot them) meets CUDA logits. The CPU twin never sees it: everything is on the CPU there."""
    script = f"""
import sys
from pathlib import Path
from marlaas_hpc.plan import dry_run, fake_cuda
fake_cuda.install(Path(sys.argv[2]))
from marlaas_hpc.trainer import packing

moved = packing.PackedBatch.to
def to(self, device):
    batch = moved(self, device)
    batch.targets = self.targets
    return batch
packing.PackedBatch.to = to
shape = dry_run.DryRunShape(model_dir=sys.argv[1], tensor_parallel=1, micro_batch_tokens=512, row_tokens=256,
                            max_adapters=1)
dry_run.run(shape, Path(sys.argv[2]))
"""
    proc = subprocess.run([sys.executable, "-c", script, str(model_config_dir("random:qwen3-0.6b-mini")),
                           str(tmp_path / "cache")], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode != 0
    assert "FakeTensorDeviceMismatchError" in proc.stderr and "cuda:0" in proc.stderr and "cpu" in proc.stderr


def test_the_fused_rms_norm_twin_computes_what_torch_s_rms_norm_computes():
    """The twin stands in for torch's fused CUDA kernel in the dry run; on real tensors it must compute the same
    output and gradients as torch's rms_norm, or a dry run that routes through it would train something else."""
    import torch
    from marlaas_hpc.plan.fake_cuda import fused_rms_norm_twin
    twin = fused_rms_norm_twin(torch.nn.functional.rms_norm, on=lambda input: True)
    torch.manual_seed(0)
    x = torch.randn(6, 3, 64)
    weight = torch.randn(64)
    outputs, grads = [], []
    for norm in (torch.nn.functional.rms_norm, twin):
        xi, wi = x.clone().requires_grad_(), weight.clone().requires_grad_()
        out = norm(xi, (64,), wi, 1e-6)
        (out * torch.arange(64, dtype=out.dtype)).sum().backward()
        outputs.append(out.detach())
        grads.append((xi.grad, wi.grad))
    torch.testing.assert_close(outputs[1], outputs[0])
    torch.testing.assert_close(grads[1][0], grads[0][0])
    torch.testing.assert_close(grads[1][1], grads[0][1])
