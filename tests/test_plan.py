"""`marlaas plan`: each GPU rank's device memory from config.json alone (marlaas_hpc/plan/estimate.py), its refusals
naming the field to change, and the same check in `marlaas run` / `submit`. The estimate's activation terms are
checked against the GPU dry run in test_dry_run.py."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from marlaas_hpc.config import JobConfig
from marlaas_hpc.config_loader import SpecError
from marlaas_hpc.launch.layout import JobLayout, LayoutError
from marlaas_hpc.model.random_checkpoints import SHAPES, hf_config
from marlaas_hpc.model.shape import ModelShape
from marlaas_hpc.plan.command import check_fits, gpu_kinds, model_dims, trainer_inputs, trainer_total
from marlaas_hpc.plan.estimate import GIB, lora_elements
from support.configs import with_changes
from support.jobs import marlaas

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "configs" / "qwen3-0.6b-gsm8k.yaml"
GOLDEN = ROOT / "tests" / "golden" / "plan_qwen3_0.6b.txt"


def shipped(tmp_path, **changes) -> Path:
    """The shipped GPU config with `changes` (dotted keys) and a random shape as its model."""
    data = yaml.safe_load(SHIPPED.read_text())
    data["model"] = "random:qwen3-0.6b"
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(with_changes(data, changes)))
    return path


@pytest.mark.parametrize("name", ["qwen3-0.6b", "qwen3-8b", "qwen3-8b-mini"])
def test_the_model_shape_reads_back_from_config_json_and_counts_the_parameters_transformers_builds(name):
    import torch
    from transformers import Qwen3ForCausalLM

    config = hf_config(SHAPES[name])
    with torch.device("meta"):
        model = Qwen3ForCausalLM(config)
    shape = ModelShape.from_config(config.to_dict())
    assert shape == SHAPES[name].shape, "one shape: the random checkpoint's is what its config.json reads back as"
    assert shape.parameters() == sum(p.numel() for p in model.parameters())


def test_lora_elements_are_peft_s_for_the_seven_projections_at_tp1():
    """At TP=1 the trainer's fused sites hold what PEFT's seven adapters hold, less the shared A of fused parts."""
    dims = model_dims(JobConfig(), "random:qwen3-0.6b")[0]
    h, d, f, r = dims.hidden_size, dims.head_dim, dims.intermediate_size, 32
    q, kv = dims.num_heads * d, dims.num_kv_heads * d
    peft = r * (h + q) + 2 * r * (h + kv) + r * (q + h) + 2 * r * (h + f) + r * (f + h)
    shared_a = 2 * r * h + r * h  # k and v share q's A (qkv site), up shares gate's (fc1 site)
    assert lora_elements(dims, 1, r) == dims.num_layers * (peft - shared_a)


def test_plan_of_the_shipped_config(tmp_path):
    proc = marlaas("plan", str(SHIPPED.relative_to(ROOT)), "--model", "random:qwen3-0.6b")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == GOLDEN.read_text(), "plan output changed: update tests/golden/plan_qwen3_0.6b.txt if meant"


def test_plan_of_the_placeholder_model_asks_for_a_config_json():
    proc = marlaas("plan", str(SHIPPED.relative_to(ROOT)))
    assert proc.returncode == 2 and "model: '/path/to/Qwen3-0.6B' holds no config.json" in proc.stderr
    assert "--model" in proc.stderr


def test_a_trainer_that_does_not_fit_exits_1_naming_the_field_and_a_value_that_fits(tmp_path):
    changes = {"layout.trainer_tp": 1}
    proc = marlaas("plan", str(shipped(tmp_path, **changes, **{"trainer.micro_batch_tokens": 65536})))
    assert proc.returncode == 1 and "DOES NOT FIT" in proc.stdout
    message = proc.stderr.strip().splitlines()[-1]
    assert message.startswith("marlaas: trainer.micro_batch_tokens: a trainer rank needs"), message
    assert "or set trainer.recompute: true (" in message  # every change that alone fits is offered
    fitting = int(message.split("lower trainer.micro_batch_tokens to at most ")[1].split(",")[0].split()[0])
    assert 16384 <= fitting < 65536
    assert marlaas("plan", str(shipped(tmp_path, **changes, **{"trainer.micro_batch_tokens": fitting}))).returncode == 0
    assert marlaas("plan", str(shipped(tmp_path, **changes,
                                       **{"trainer.micro_batch_tokens": fitting + 256}))).returncode == 1


def test_recompute_is_named_when_it_alone_fits(tmp_path):
    """Qwen3-8B at TP=2 and 24k tokens: its activations do not fit an 80 GiB GPU, its checkpoints do."""
    path = shipped(tmp_path, **{"trainer.micro_batch_tokens": 24576})
    job = JobConfig.load(path).validate()
    dims, _ = model_dims(job, "random:qwen3-8b")
    inputs = trainer_inputs(job, dims)
    assert trainer_total(inputs) > 80 * GIB
    proc = marlaas("plan", str(path), "--model", "random:qwen3-8b")
    assert proc.returncode == 1 and "set trainer.recompute: true" in proc.stderr, proc.stderr


def test_a_kv_cache_without_room_for_one_sequence_names_gpu_memory_utilization(tmp_path):
    proc = marlaas("plan", str(shipped(tmp_path, **{"vllm.gpu_memory_utilization": 0.03})))
    assert proc.returncode == 1
    assert "marlaas: vllm.gpu_memory_utilization: a rollout rank's KV cache holds" in proc.stderr
    assert "raise vllm.gpu_memory_utilization to at least 0.0" in proc.stderr


def test_share_gpus_leaves_the_trainer_what_vllm_does_not_take(tmp_path):
    alone = marlaas("plan", str(shipped(tmp_path)))
    assert alone.returncode == 0, alone.stderr
    shared = marlaas("plan", str(shipped(tmp_path, **{"layout.share_gpus": True, "layout.rollout_ranks": 1})))
    assert shared.returncode == 1 and "of 11.94 GiB" in shared.stderr, shared.stderr  # 79.6 GiB x (1 - 0.85)


def test_gpu_memory_gib_is_validated():
    assert JobLayout.from_dict({"trainer": {"gpu_memory_gib": 141}}).trainer.gpu_memory_gib == 141
    for bad in (0, -1, True, 5000):
        with pytest.raises(LayoutError) as caught:
            JobLayout.from_dict({"trainer": {"gpu_memory_gib": bad}})
        assert caught.value.field == "trainer.gpu_memory_gib"


def test_gpu_kinds_are_the_ranks_that_run_on_gpus(tmp_path):
    job = JobConfig.load(shipped(tmp_path)).validate()
    assert gpu_kinds(job) == ["rollout", "trainer"]  # under Slurm: both components ask for GPUs
    assert gpu_kinds(job, gpus_visible=False) == []  # local mode on a machine without GPUs
    job.engine = "hf"
    assert gpu_kinds(job, gpus_visible=True) == ["trainer"]
    job.layout.accelerator = "cpu"
    assert gpu_kinds(job, gpus_visible=True) == []


def test_check_fits_names_the_field(tmp_path):
    job = JobConfig.load(shipped(tmp_path, **{"layout.trainer.gpu_memory_gib": 16})).validate()
    with pytest.raises(SpecError) as caught:
        check_fits(job, gpus_visible=True)
    assert caught.value.field == "trainer.micro_batch_tokens"
    check_fits(job, gpus_visible=False)  # CPU ranks: nothing to check


def test_submit_refuses_a_job_whose_trainer_does_not_fit_before_slurm(tmp_path):
    path = shipped(tmp_path, **{"layout.trainer.gpu_memory_gib": 16})
    proc = marlaas("submit", str(path), "--run-dir", str(tmp_path / "run"))
    assert proc.returncode == 2, proc.stderr
    assert "marlaas: not submitted: trainer.micro_batch_tokens: a trainer rank needs" in proc.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("micro_batch_tokens", [8192, 32768])
def test_the_estimate_is_within_25_percent_of_a_cpu_trainer_step_s_peak_rss(micro_batch_tokens):
    """The tiny model, a local-demo-like fused step (8 tasks of LoRA r16, 4 fused, rows of 48 tokens) on the CPU:
    baseline RSS (torch, megatron-core, transformers imported) + the estimate for the CPU path (float32 weights,
    dense attention) against the step's peak RSS (tools/plan_calibration.py; glibc's mmap threshold fixed so RSS
    follows the live tensors)."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "tools/plan_calibration.py", "--micro-batch-tokens",
                           str(micro_batch_tokens), "--row-tokens", "48"], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["plan_bytes"] > 0.4 * result["step_peak_rss_bytes"], result  # the estimate carries the sum
    assert result["estimate_bytes"] == pytest.approx(result["step_peak_rss_bytes"], rel=0.25), result


def test_the_estimate_uses_the_lm_head_s_chunk():
    """estimate.py repeats trainer/lm_head.py's LOGITS_CHUNK_BYTES (that module imports torch)."""
    from marlaas_hpc.plan.estimate import LOGITS_CHUNK_BYTES
    from marlaas_hpc.trainer.lm_head import LOGITS_CHUNK_BYTES as TRAINER_S

    assert LOGITS_CHUNK_BYTES == TRAINER_S


# ---- a plan that holds on a real device (issue #36 item 5) ----
def _plan(path: Path, *args) -> subprocess.CompletedProcess:
    return marlaas("plan", str(path), *args)


def test_qwen3_8b_at_tp2_on_an_h100_is_refused_naming_the_field_to_change(tmp_path):
    """What an 80 GB H100 reports (79.6 GiB) and every term a real GPU holds: the leader's delta buffers in flight,
    NCCL's buffers, the allocator's reserve. Before they were counted, 78.2-79.2 GiB were planned: 'fits'."""
    path = shipped(tmp_path, **{"layout.trainer_tp": 2, "layout.trainer.gpu_memory_gib": 79.6})
    proc = _plan(path, "--model", "random:qwen3-8b")
    assert proc.returncode == 1, proc.stdout
    assert "marlaas: trainer.micro_batch_tokens: a trainer rank needs" in proc.stderr
    for line in ("delta buffers in flight (the leader's, NCCL): 16 x 0.33 GiB adapter", "allocator reserve: 0.1",
                 "NCCL buffers: 2 communicator(s) (TP, delta channel)"):
        assert line in proc.stdout, proc.stdout


def test_the_shipped_plan_counts_delta_buffers_and_the_allocator_reserve(tmp_path):
    inputs = trainer_inputs(JobConfig.load(SHIPPED).validate(), model_dims(JobConfig(), "random:qwen3-0.6b")[0])
    from marlaas_hpc.plan.estimate import adapter_bytes, trainer_memory

    memory = trainer_memory(inputs)
    assert inputs.delta_buffers == 16 and memory.delta_in_flight == 16 * adapter_bytes(inputs)
    assert 1.25e9 < memory.delta_in_flight < 1.35e9  # ~1.3 GB at Qwen3-0.6B r32 (issue #36)
    assert memory.reserve == int(0.1 * memory.tensors) and memory.total == memory.tensors + memory.reserve + memory.nccl
    relay = trainer_inputs(JobConfig.load(shipped(tmp_path, **{"delta": {"transport": "relay"}})).validate(),
                           inputs.dims)
    assert relay.delta_buffers == 0 and relay.communicators == 1  # the relay's links are gloo, host memory: TP only


def test_the_plan_s_copies_of_the_code_s_constants_agree():
    """estimate.py repeats what it needs of modules that import torch: the leader's in-flight bound, FlexAttention's
    block and its mask's build chunk."""
    from marlaas_hpc.plan import estimate
    from marlaas_hpc.runtime.delta.broadcast import DeltaChannel
    from marlaas_hpc.trainer import attention

    assert estimate.DELTA_IN_FLIGHT == DeltaChannel.MAX_IN_FLIGHT
    assert (estimate.FLEX_BLOCK, estimate.FLEX_MASK_CHUNK_ELEMENTS) == (attention.FLEX_BLOCK,
                                                                         attention.MASK_CHUNK_ELEMENTS)


@pytest.mark.parametrize("gpu, gib", [({}, 79.6), ({"gpu_type": "h200"}, 139.0), ({"gpu_type": "a100-40gb"}, 39.4),
                                      ({"gpu_type": "h200", "gpu_memory_gib": 100}, 100)])
def test_gpu_memory_defaults_to_what_the_named_gpu_reports(gpu, gib):
    assert JobLayout.from_dict({"trainer": gpu}).trainer.gpu_gib == gib


def test_an_unknown_gpu_type_is_refused_naming_the_field():
    with pytest.raises(LayoutError) as refused:
        JobLayout.from_dict({"rollout": {"gpu_type": "h100"}})
    assert refused.value.field == "rollout.gpu_type" and "h100-80gb" in str(refused.value)


def test_the_delta_plane_beside_vllm_s_share_is_counted_against_the_gpu(tmp_path):
    """vLLM sizes its KV cache from its share before the delta channels exist: their buffers come on top, so a
    share that leaves too little room is refused naming vllm.gpu_memory_utilization."""
    path = shipped(tmp_path, **{"vllm.gpu_memory_utilization": 0.97})
    proc = _plan(path, "--model", "random:qwen3-8b")
    assert proc.returncode == 1
    assert "marlaas: vllm.gpu_memory_utilization: a rollout rank's GPU holds vLLM's" in proc.stderr, proc.stderr


def test_a_rollout_node_s_in_memory_adapters_are_checked_against_its_memory(tmp_path):
    path = shipped(tmp_path, **{"layout.rollout.mem": "16G"})
    proc = _plan(path, "--model", "random:qwen3-0.6b")
    assert proc.returncode == 1
    assert "marlaas: layout.rollout.mem: a rollout rank's in-memory adapters" in proc.stderr, proc.stderr
    assert "host RAM per node: in-memory adapters" in proc.stdout
