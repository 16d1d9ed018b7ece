"""A Qwen3-MoE job end to end (issue #38): a checkpoint written by transformers itself, in the published config.json
form (none of the project's builders), through `marlaas run` with a TP=2 trainer and `hf` rollouts (vLLM on CPU
does not run MoE: its fused-MoE kernels need Triton, and the job is refused up front, tests/test_real_models_mpi.py).
Two tenants: one with the MoE default targets (every expert's gate/up/down with attention), one attention-only,
in one rollout engine and one fused trainer step, the first replaying its rollouts' routing (`algo.routing_replay`:
the engine records every position's experts, the trainer routes through them). Every task finishes every step
inside its staleness bound, the replaying task's steps report how many trained tokens the trainer would have routed
otherwise (`route_mismatch`), and each task's last adapter loads with plain transformers + PEFT, its LoRA on the
experts for the first."""
import json

import pytest
import yaml

from support.jobs import ROOT, marlaas
from support.moe_scenarios import write_served_moe_checkpoint

pytestmark = [pytest.mark.mpi, pytest.mark.slow]
TWIN = ROOT / "configs" / "qwen3-gsm8k-cpu.yaml"
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


def _job(tmp_path, model) -> dict:
    config = yaml.safe_load(TWIN.read_text())
    config.update(model=str(model), engine="hf")
    config["layout"]["trainer_tp"] = 2
    for task in config["tasks"]:
        task["total_steps"] = 2
        task["dataset"]["eval_size"] = 4
        task["algo"].update(group_size=4, batch_prompts=2)
    config["tasks"][1]["lora"]["target_modules"] = ATTENTION
    # a KL term makes every row run (the random model earns no reward: zero advantages alone would skip them all)
    config["tasks"][0]["algo"].update(routing_replay=True, kl_beta=0.01)
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(config))
    return config


def test_a_transformers_written_qwen3_moe_runs_end_to_end_with_lora_on_its_experts(tmp_path):
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = write_served_moe_checkpoint(tmp_path / "qwen3-moe")
    config = _job(tmp_path, model)
    proc = marlaas("run", tmp_path / "job.yaml", "--run-dir", tmp_path / "run", timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Warning" not in proc.stderr, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["engine"] == "hf"
    assert {t: (s["status"], s["steps_done"]) for t, s in summary["tasks"].items()} == \
        {spec["task_id"]: ("done", 2) for spec in config["tasks"]}
    audit = [json.loads(line) for line in (tmp_path / "run" / "audit.jsonl").read_text().splitlines()]
    assert len(audit) == 2 * 2 * 2 * 4  # tasks x steps x B x G
    assert all(r["trained_into"] - 1 - r["bound"] <= r["behaviour_version"] < r["trained_into"] for r in audit)
    for spec, replays in zip(config["tasks"], (True, False)):
        metrics = [json.loads(line) for line in (tmp_path / "run" / "tasks" / spec["tenant"] / spec["task_id"] /
                                                 "metrics.jsonl").read_text().splitlines()]
        assert len(metrics) == 2 and all(("route_mismatch" in m) == replays for m in metrics), spec["task_id"]
        if replays:  # fp32 engine and trainer: routes and logprobs agree at the behaviour version
            assert all(0.0 <= m["route_mismatch"] <= 1.0 for m in metrics), metrics
            assert metrics[0]["logp_diff_abs"] < 1e-3, metrics[0]
    base = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32)
    for spec, on_experts in zip(config["tasks"], (True, False)):
        last = sorted((tmp_path / "run" / "tasks" / spec["tenant"] / spec["task_id"] / "adapters").iterdir())[-1]
        keys = load_file(str(last / "adapter_model.safetensors")).keys()
        expert_keys = [k for k in keys if ".mlp.experts." in k]
        # layer 1 is a dense MLP (mlp_only_layers): no MLP adapter there; layers 0 and 2 route to 8 experts each
        assert len(expert_keys) == (2 * 8 * 3 * 2 if on_experts else 0), (spec["task_id"], sorted(keys)[:6])
        peft = PeftModel.from_pretrained(base, str(last)).eval()
        lora = [name for name, _ in peft.named_parameters() if "lora_" in name]
        assert lora and any("experts" in name for name in lora) == on_experts, spec["task_id"]
        base = peft.unload()
