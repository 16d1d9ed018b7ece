"""Expert parallelism in the runtime (issue #38, `layout.trainer_ep`): a transformers-written Qwen3-MoE through `marlaas
run` with one trainer group of two DP ranks that split the experts (trainer_dp 2, trainer_ep 2: each holds 4 of each
MoE layer's 8 experts, their LoRA and its optimizer state). USR2 checkpoints every task: each EP rank writes its own
share ('tp0', 'tp0-ep1'), and `--resume` loads each share back on its rank; every version of every task is trained
exactly once, and each task's last adapter holds every expert's LoRA (gathered over the EP group) and loads with
plain transformers + PEFT."""
import collections
import json

import pytest
import yaml

from support.jobs import ROOT, marlaas, preempt_after
from support.moe_scenarios import write_served_moe_checkpoint

pytestmark = [pytest.mark.mpi, pytest.mark.slow]
TWIN = ROOT / "configs" / "qwen3-gsm8k-cpu.yaml"
STEPS = 5


def _job(tmp_path, model) -> dict:
    config = yaml.safe_load(TWIN.read_text())
    config.update(model=str(model), engine="hf")
    config["layout"].update(trainer_tp=1, trainer_dp=2, trainer_ep=2)
    for task in config["tasks"]:
        task["total_steps"] = STEPS
        task["dataset"]["eval_size"] = 4
        task["algo"].update(group_size=4, batch_prompts=2, kl_beta=0.01)  # KL: rows run without reward
    config["tasks"][0]["algo"]["routing_replay"] = True
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(config))
    return config


def test_expert_parallel_trainer_checkpoints_each_ranks_experts_and_resumes(tmp_path):
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from marlaas_hpc.runtime.checkpoint import load_job_checkpoint

    model = write_served_moe_checkpoint(tmp_path / "qwen3-moe")
    config = _job(tmp_path, model)
    run_dir = tmp_path / "run"
    code, out = preempt_after(tmp_path / "job.yaml", run_dir, steps=2, timeout_s=900)
    assert code == 75, out[-3000:]
    tenants = {t["task_id"]: t["tenant"] for t in config["tasks"]}
    saved = {t: r["saved"]["version"] for t, r in load_job_checkpoint(run_dir)["tasks"].items()}
    # tasks go at their own pace: one may have run ahead and ended before the USR2 (an ended task keeps no shards)
    unfinished = {task_id: version for task_id, version in saved.items() if version < STEPS}
    assert unfinished, saved
    for task_id, version in unfinished.items():
        folder = run_dir / "tasks" / tenants[task_id] / task_id / "checkpoint"
        shares = [torch.load(folder / f"{shard}-v{version:06d}.pt", weights_only=False) for shard in ("tp0", "tp0-ep1")]
        assert [(s["expert_parallel"], s["ep_rank"]) for s in shares] == [(2, 0), (2, 1)], task_id

    resumed = marlaas("run", "--resume", run_dir, timeout=900)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "Warning" not in resumed.stderr, resumed.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    audit = [json.loads(line) for line in (run_dir / "audit.jsonl").read_text().splitlines()]
    base = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32)
    for task in config["tasks"]:
        task_id, algo = task["task_id"], task["algo"]
        assert (summary["tasks"][task_id]["status"], summary["tasks"][task_id]["steps_done"]) == ("done", STEPS)
        per_version = collections.Counter(r["trained_into"] for r in audit if r["task_id"] == task_id)
        assert per_version == {v: algo["batch_prompts"] * algo["group_size"] for v in range(1, STEPS + 1)}
        last = sorted((run_dir / "tasks" / tenants[task_id] / task_id / "adapters").iterdir())[-1]
        keys = load_file(str(last / "adapter_model.safetensors")).keys()
        # layers 0 and 2 route to 8 experts each (layer 1 is dense): both EP ranks' experts, A and B of 3 projections
        assert len([k for k in keys if ".mlp.experts." in k]) == 2 * 8 * 3 * 2, sorted(keys)[:6]
        peft = PeftModel.from_pretrained(base, str(last)).eval()
        assert any("experts" in name and "lora_" in name for name, _ in peft.named_parameters())
        base = peft.unload()
