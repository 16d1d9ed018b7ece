"""The job config's `vllm:` section (rollout/vllm_settings.py): validated field by field, mapped onto the
engine's arguments, and checked against the layout (a rollout rank owns its engine's GPUs). No vLLM import."""
from __future__ import annotations

import ast
import dataclasses
import inspect

import pytest
import yaml

from marlaas_hpc.config import JobConfig
from marlaas_hpc.rollout.vllm_settings import VllmSettings
from marlaas_hpc.tasks.spec import SpecError


def test_vllm_settings_defaults_keep_the_cpu_twin_exact():
    kwargs = JobConfig.from_dict({}).vllm.engine_kwargs(max_adapters=8, max_lora_rank=16, max_staleness=1)
    assert kwargs == dict(dtype="float32", gpu_memory_utilization=0.5, max_model_len=None, enforce_eager=True,
                          tensor_parallel_size=1, max_num_seqs=None, max_loras=24, max_cpu_loras=48,
                          max_lora_rank=16, enable_prefix_caching=None, kv_cache_gib=1)


def _live_versions_after_an_update(tasks: int, k: int) -> int:
    """LoRA ids a rollout engine's batch holds when every task has just published v+1 while groups sampled from
    v-k .. v (which the bound k still lets train) are generating: its book-keeping (AdapterVersions) counted."""
    from marlaas_hpc.rollout.base import AdapterRef, AdapterVersions

    versions, v = AdapterVersions(), 10
    for task in range(tasks):
        for version in range(v - k, v + 2):  # each was the newest when its groups started; v+1 just arrived
            versions.add(AdapterRef(f"t{task}", version, path=f"/adapters/t{task}/v{version}"))
            versions.acquire(f"t{task}", version)  # a request on it (v+1: the first group sampled with it)
    return len(versions.int_id)


@pytest.mark.parametrize("bounds", [[1], [0, 0], [1, 1, 2], [3]])
def test_default_lora_slots_cover_every_version_live_after_an_update(bounds):
    """Each (task, version) is a LoRA id of its own, and vLLM's scheduler keeps a waiting request out of the batch
    while the running ones already use max_loras ids: a batch short of slots stalls each task's new version
    until its old ones drain. The default covers max_adapters tasks of the job's largest bound."""
    tasks = [{"task_id": f"t{i}", "tenant": "a", "max_staleness": k} for i, k in enumerate(bounds)]
    job = JobConfig.from_dict({"max_adapters": 4, "tasks": tasks})
    kwargs = job.vllm.engine_kwargs(job.max_adapters, job.max_lora_rank, job.largest_staleness())
    assert kwargs["max_loras"] >= _live_versions_after_an_update(job.max_adapters, max(bounds))
    assert kwargs["max_cpu_loras"] >= kwargs["max_loras"]


def test_the_shipped_gpu_config_has_a_slot_for_every_live_version():
    from pathlib import Path

    job = JobConfig.from_dict(yaml.safe_load((Path(__file__).resolve().parents[1] / "configs" /
                                              "qwen3-0.6b-gsm8k.yaml").read_text()))
    kwargs = job.vllm.engine_kwargs(job.max_adapters, job.max_lora_rank, job.largest_staleness())
    live = sum(_live_versions_after_an_update(1, task.max_staleness) for task in job.tasks)
    assert kwargs["max_loras"] >= live and kwargs["max_cpu_loras"] >= kwargs["max_loras"], (kwargs, live)


def test_vllm_settings_map_one_to_one_from_yaml():
    job = JobConfig.from_dict(yaml.safe_load("""
vllm: {dtype: bfloat16, gpu_memory_utilization: 0.9, max_model_len: 2048, enforce_eager: false,
       max_num_seqs: 64, max_loras: 4, max_cpu_loras: 6, enable_prefix_caching: true, cpu_kv_cache_gib: 2}
"""))
    kwargs = job.vllm.engine_kwargs(job.max_adapters, job.max_lora_rank, job.largest_staleness())
    assert kwargs["dtype"] == "bfloat16" and kwargs["gpu_memory_utilization"] == 0.9
    assert kwargs["max_model_len"] == 2048 and kwargs["enforce_eager"] is False and kwargs["max_num_seqs"] == 64
    assert (kwargs["max_loras"], kwargs["max_cpu_loras"]) == (4, 6) and kwargs["enable_prefix_caching"] is True
    assert kwargs["kv_cache_gib"] == 2


@pytest.mark.parametrize("data, field, words", [
    ({"vllm": {"dtype": "fp8"}}, "vllm.dtype", "must be one of"),
    ({"vllm": {"gpu_memory_utilization": 1.5}}, "vllm.gpu_memory_utilization", "in (0.0, 1.0]"),
    ({"vllm": {"gpu_memory_utilization": 0}}, "vllm.gpu_memory_utilization", "in (0.0, 1.0]"),
    ({"vllm": {"max_model_len": 0}}, "vllm.max_model_len", ">= 1"),
    ({"vllm": {"max_num_seqs": "many"}}, "vllm.max_num_seqs", "integer"),
    ({"vllm": {"enforce_eager": "no"}}, "vllm.enforce_eager", "true or false"),
    ({"vllm": {"enable_prefix_caching": 1}}, "vllm.enable_prefix_caching", "true or false"),
    ({"vllm": {"seeded_sampling": "yes"}}, "vllm.seeded_sampling", "true or false"),
    ({"vllm": {"tensor_parallel_size": 0}}, "vllm.tensor_parallel_size", ">= 1"),
    ({"vllm": {"cpu_kv_cache_gib": -1}}, "vllm.cpu_kv_cache_gib", "in (0.0, 1024.0]"),
    ({"vllm": {"cpu_kv_cache_gib": 0}}, "vllm.cpu_kv_cache_gib", "in (0.0, 1024.0]"),
    ({"vllm": {"cpu_kv_cache_gib": "1G"}}, "vllm.cpu_kv_cache_gib", "number"),
    ({"vllm": {"max_loras": 4, "max_cpu_loras": 2}}, "vllm.max_cpu_loras", "below max_loras"),
    ({"vllm": {"max_cpu_loras": 4}}, "vllm.max_cpu_loras", "24 LoRA slots"),
    ({"vllm": {"tensor_paralel_size": 2}}, "vllm.tensor_paralel_size", "unknown field"),
    ({"vllm": {"tensor_parallel_size": 2}}, "vllm.tensor_parallel_size", "layout.rollout.gpus_per_task is 0"),
    ({"vllm": {"tensor_parallel_size": 2}, "layout": {"rollout": {"gpus_per_task": 1}}},
     "vllm.tensor_parallel_size", "must be equal"),
    ({"layout": {"rollout": {"gpus_per_task": 2}}}, "vllm.tensor_parallel_size", "is 1 but"),
    ({"engine": "hf", "layout": {"rollout": {"gpus_per_task": 2}}}, "layout.rollout.gpus_per_task", "hf engine"),
    ({"layout": {"trainer": {"gpus_per_task": 2}}}, "layout.trainer.gpus_per_task", "one GPU"),
    ({"layout": {"accelerator": "tpu"}}, "layout.accelerator", "expected one of"),
    ({"model": ""}, "model", "path of an HF checkpoint"),
    ({"model": 5}, "model", "expected a string"),
    ({"model": "random:qwen3-70b"}, "model", "unknown random checkpoint"),
])
def test_vllm_settings_and_device_fields_refused_naming_the_field(data, field, words):
    with pytest.raises(SpecError) as info:
        JobConfig.from_dict(data)
    assert info.value.field == field and words in str(info.value), str(info.value)


@pytest.mark.parametrize("accelerator, given, decided, on_cpu, on_gpu", [
    ("cpu", None, True, True, True),  # the CPU twin: every run samples the same tokens
    ("cuda", None, False, False, False),  # GPUs: vLLM's batched FlashInfer sampler, not seeded rows one by one
    ("auto", None, None, True, False),  # decided by each rank from the device it was given
    ("auto", False, False, False, False),
    ("cpu", False, False, False, False),
    ("cuda", True, True, True, True),
])
def test_seeded_sampling_defaults_to_the_accelerator(accelerator, given, decided, on_cpu, on_gpu):
    vllm = {} if given is None else {"seeded_sampling": given}
    job = JobConfig.from_dict({"vllm": vllm, "layout": {"accelerator": accelerator}})
    assert job.vllm.seeded_sampling is decided
    assert (job.vllm.seeded(on_gpu=False), job.vllm.seeded(on_gpu=True)) == (on_cpu, on_gpu)


def test_vllm_settings_tp_equal_to_the_rollout_gpus_is_valid():
    job = JobConfig.from_dict({"vllm": {"tensor_parallel_size": 4}, "layout": {"rollout": {"gpus_per_task": 4}}})
    assert job.vllm.tensor_parallel_size == 4
    assert JobConfig.from_dict({"layout": {"rollout": {"gpus_per_task": 1}}}).vllm.tensor_parallel_size == 1


def test_vllm_settings_every_field_has_a_docstring():
    import marlaas_hpc.rollout.vllm_settings as module

    node = next(n for n in ast.parse(inspect.getsource(module)).body
                if isinstance(n, ast.ClassDef) and n.name == "VllmSettings")
    documented = {stmt.target.id for stmt, nxt in zip(node.body, node.body[1:])
                  if isinstance(stmt, ast.AnnAssign) and isinstance(nxt, ast.Expr)
                  and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)}
    assert {f.name for f in dataclasses.fields(VllmSettings)} == documented


def test_placeholder_model_loads_but_model_path_refuses(tmp_path):
    job = JobConfig.from_dict({"model": str(tmp_path / "Qwen3-0.6B")})
    with pytest.raises(SpecError, match="is not an HF checkpoint dir") as info:
        job.model_path()
    assert info.value.field == "model"
    (tmp_path / "Qwen3-0.6B").mkdir()
    (tmp_path / "Qwen3-0.6B" / "config.json").write_text("{}")
    assert job.model_path() == tmp_path / "Qwen3-0.6B"
