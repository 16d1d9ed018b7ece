"""Trainer pieces that need no process group: config validation, the LoRA context, init, PEFT files."""
from __future__ import annotations

import json

import pytest
import torch

from marlaas_hpc.tasks.spec import LoraSpec, SpecError
from marlaas_hpc.trainer.lora import LoraContext, kaiming_uniform_a, peft_key
from marlaas_hpc.trainer.peft_io import read_peft_adapter, write_peft_adapter
from marlaas_hpc.trainer.trainer import TrainerConfig


def test_trainer_config_names_the_bad_field(tiny_model_path, tmp_path):
    assert TrainerConfig(model_path=str(tiny_model_path)).validate().tensor_parallel == 1
    cases = [({"model_path": str(tmp_path)}, "model_path"),
             ({"model_path": str(tiny_model_path), "tensor_parallel": 0}, "tensor_parallel"),
             ({"model_path": str(tiny_model_path), "micro_batch_tokens": -1}, "micro_batch_tokens"),
             ({"model_path": str(tiny_model_path), "seed": 1.5}, "seed"),
             ({"model_path": str(tiny_model_path), "device": "tpu"}, "device"),
             ({"model_path": str(tiny_model_path), "device": "cuda:x"}, "device"),
             ({"model_path": str(tiny_model_path), "dtype": "float16"}, "dtype"),
             ({"model_path": str(tiny_model_path), "recompute": "yes"}, "recompute")]
    if not torch.cuda.is_available():
        cases.append(({"model_path": str(tiny_model_path), "device": "cuda:0"}, "device"))
    for kwargs, field in cases:
        with pytest.raises(SpecError) as info:
            TrainerConfig(**kwargs).validate()
        assert info.value.field == field


def test_lora_context_groups_rows_by_adapter():
    ctx = LoraContext()
    cpu = torch.device("cpu")
    assert ctx.groups(cpu) == []
    with ctx.use("a", batch=3):
        assert ctx.groups(cpu) == [("a", None)]  # one adapter on every row: no indexing
        with ctx.use(["a", None, "b", "a"]):
            groups = {name: rows.tolist() for name, rows in ctx.groups(cpu)}
            assert groups == {"a": [0, 3], "b": [2]}  # row 1 is base only
        assert ctx.rows == ("a", "a", "a")  # restored on exit
    with ctx.use(None, batch=2):
        assert ctx.groups(cpu) == []
    with pytest.raises(ValueError):
        with ctx.use("a"):
            pass


def test_lora_a_init_is_seeded_and_peft_scaled():
    a = kaiming_uniform_a(8, 128, seed=3)
    assert torch.equal(a, kaiming_uniform_a(8, 128, seed=3))
    assert not torch.equal(a, kaiming_uniform_a(8, 128, seed=4))
    assert a.abs().max() <= 1 / 128 ** 0.5 and a.abs().max() > 0.8 / 128 ** 0.5


def test_peft_keys_match_what_peft_writes(make_lora_adapter):
    from safetensors.torch import load_file

    written = set(load_file(str(make_lora_adapter("keys") / "adapter_model.safetensors")))
    ours = {peft_key(layer, m, w) for layer in range(4) for m in LoraSpec().target_modules for w in "AB"}
    assert ours == written


def test_peft_files_round_trip_and_replace_atomically(tmp_path):
    spec = LoraSpec(rank=2, alpha=6.0, target_modules=("v_proj", "q_proj"))
    tensors = {peft_key(0, "q_proj", "A"): torch.randn(2, 8), peft_key(0, "q_proj", "B"): torch.randn(8, 2)}
    out = tmp_path / "adapter"
    write_peft_adapter(out, tensors, spec, base_model_name_or_path="base")
    tensors[peft_key(0, "q_proj", "B")] = torch.ones(8, 2)
    write_peft_adapter(out, tensors, spec, base_model_name_or_path="base")  # replaces in place
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"]  # no staging leftovers
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["peft_type"], config["task_type"]) == (2, 6.0, "LORA",
                                                                                           "CAUSAL_LM")
    assert config["base_model_name_or_path"] == "base" and config["lora_dropout"] == 0.0
    read_spec, read_tensors = read_peft_adapter(out)
    assert (read_spec.rank, read_spec.alpha, set(read_spec.target_modules)) == (2, 6.0, {"q_proj", "v_proj"})
    assert torch.equal(read_tensors[peft_key(0, "q_proj", "B")], torch.ones(8, 2))


def test_read_peft_rejects_unsupported_variants(tmp_path):
    spec = LoraSpec(rank=2, alpha=2.0, target_modules=("q_proj",))
    out = write_peft_adapter(tmp_path / "dora", {peft_key(0, "q_proj", "A"): torch.zeros(2, 4)}, spec)
    config = json.loads((out / "adapter_config.json").read_text())
    config["use_dora"] = True
    (out / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="use_dora"):
        read_peft_adapter(out)
