"""Jobs on real-shaped checkpoints end to end, the CPU twin learning, and checkpoints the job cannot serve refused
up front.

`marlaas run configs/qwen3-gsm8k-cpu.yaml` (the CPU twin of the paper's GSM8K setting: vLLM engine, trainer TP=2,
chat prompts) on the project's small chat model (model/chat_mini.py: Qwen3, tied embeddings, the 151,936-row
vocabulary padded at TP=2) raises each task's greedy eval accuracy, its '####' task stopping at <|im_end|> and its
\\boxed{} task at <|endoftext|>. The same job, cut short, on a random-weight checkpoint of each served family
(Qwen3, Qwen2.5, Llama 3.x), one task reading a verl-style parquet file, finishes every task with PEFT-loadable
adapters. A checkpoint of another model type (a mixture-of-experts family not served: Mixtral), a TP size that does
not divide the heads, a head_dim vLLM's CPU attention lacks, a Qwen3-MoE on vLLM's CPU backend (which cannot run
MoE), a missing path, or chat prompts on a tokenizer without a chat template:
`marlaas run` exits 2 with the field and the reason before mpirun starts."""
import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from support.jobs import ROOT, marlaas

pytestmark = [pytest.mark.mpi, pytest.mark.slow]
TWIN = ROOT / "configs" / "qwen3-gsm8k-cpu.yaml"
FAMILY_MODELS = ["random:qwen3-0.6b-mini", "random:qwen2.5-0.5b-mini", "random:llama3.2-1b-mini"]


def test_the_cpu_twin_learns_through_chat_prompts_multi_eos_and_tp2(tmp_path):
    proc = marlaas("run", TWIN, "--run-dir", tmp_path / "run", timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["model"] == "chat-mini" and summary["engine"] == "vllm" and not any(
        summary["engine_restarts"].values())
    config = yaml.safe_load(TWIN.read_text())
    for spec in config["tasks"]:
        task = summary["tasks"][spec["task_id"]]
        assert task["status"] == "done" and task["steps_done"] == spec["total_steps"]
        # measured 0.42 -> 1.00 ('####') and 0.34 -> 0.98 (\\boxed{}) in 8 steps (docs/benchmarks.md)
        assert 0.15 <= task["eval_accuracy_before"] <= 0.6, task
        assert task["eval_accuracy_after"] >= task["eval_accuracy_before"] + 0.25, task
        metrics = [json.loads(line) for line in (tmp_path / "run" / "tasks" / spec["tenant"] / spec["task_id"] /
                                                 "metrics.jsonl").read_text().splitlines()]
        # rollouts end at the task's eos id ('#### 12<|im_end|>': ~13 tokens, '... \\boxed{12}.<|endoftext|>': ~17),
        # far below the 24-token cap an engine deaf to the second eos id would run to
        assert sum(m["tokens"] for m in metrics) / sum(m["trajectories"] for m in metrics) < 20
        assert metrics[0]["logp_diff_abs"] < 1e-3  # vLLM's behaviour logprobs = the TP=2 trainer's at v0


def _twin_on(model: str, path: Path) -> Path:
    """The twin's job with another base model (chat prompts, vLLM, TP=2); its second task reads a verl-style
    parquet file (chat-message prompts, the answer in reward_model.ground_truth) through `datasets`."""
    import datasets

    rows = [{"prompt": [{"role": "user", "content": f"What is {i} + {i}? Answer in \\boxed{{}}."}],
             "reward_model": {"style": "rule", "ground_truth": str(2 * i)}, "extra_info": {"index": i}}
            for i in range(12)]
    datasets.Dataset.from_list(rows).to_parquet(str(path.parent / "train.parquet"))
    config = _small(yaml.safe_load(TWIN.read_text()), model)
    config["tasks"][1].update(task_id="math-parquet", dataset={
        "kind": "math", "path": str(path.parent / "train.parquet"), "eval_size": 4, "answer_format": "boxed",
        "fields": {"prompt": "prompt", "answer": "reward_model.ground_truth"}})
    path.write_text(yaml.safe_dump(config))
    return path


def _small(config: dict, model: str) -> dict:
    """The twin's job on another model, cut to 2 steps of 2 groups of 4 per task and 4 eval prompts."""
    config["model"] = model
    for task in config["tasks"]:
        task["total_steps"] = 2
        task["dataset"]["eval_size"] = 4
        task["algo"].update(group_size=4, batch_prompts=2)
    return config


@pytest.mark.parametrize("model", FAMILY_MODELS)
def test_chat_jobs_on_every_family_run_end_to_end(tmp_path, model):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from marlaas_hpc.model.codec import TextCodec
    from marlaas_hpc.model.random_checkpoints import ensure_random_checkpoint
    from marlaas_hpc.tasks.spec import PromptSpec

    proc = marlaas("run", _twin_on(model, tmp_path / "job.yaml"), "--run-dir", tmp_path / "run", timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["model"] == model and summary["engine"] == "vllm"
    assert {t: (s["status"], s["steps_done"]) for t, s in summary["tasks"].items()} == \
        {"gsm8k-hash": ("done", 2), "math-parquet": ("done", 2)}
    audit = [json.loads(line) for line in (tmp_path / "run" / "audit.jsonl").read_text().splitlines()]
    assert len(audit) == 2 * 2 * 2 * 4  # tasks x steps x B x G
    assert all(r["trained_into"] - 1 - r["bound"] <= r["behaviour_version"] < r["trained_into"] for r in audit)
    model_path = ensure_random_checkpoint(model.split(":", 1)[1])
    base = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32)
    ids = torch.tensor([TextCodec.from_pretrained(model_path).for_prompt(PromptSpec(format="chat")).encode_prompt("hi")])
    with torch.no_grad():
        reference = base(input_ids=ids).logits
    for tenant, task in (("alice", "gsm8k-hash"), ("bob", "math-parquet")):
        adapters = sorted((tmp_path / "run" / "tasks" / tenant / task / "adapters").iterdir())
        assert [a.name for a in adapters] == ["v0000", "v0001", "v0002"]
        config = json.loads((adapters[-1] / "adapter_config.json").read_text())
        assert config["r"] == 16 and config["base_model_name_or_path"] == str(model_path)
        peft = PeftModel.from_pretrained(base, str(adapters[-1])).eval()
        with torch.no_grad():
            logits = peft(input_ids=ids).logits
        # random weights answer nothing right: every reward and advantage is 0, so B stays 0 and the loaded
        # adapter must reproduce the base model exactly (a garbled export would not)
        assert logits.shape == reference.shape and float((logits - reference).abs().max()) < 1e-5
        metrics = [json.loads(line) for line in
                   (tmp_path / "run" / "tasks" / tenant / task / "metrics.jsonl").read_text().splitlines()]
        assert [m["version"] for m in metrics] == [1, 2] and all(m["tokens"] > 0 for m in metrics)
        base = peft.unload()


def _checkpoint_copy(src: Path, dst: Path, **config_changes) -> Path:
    """Config and tokenizer of `src` (no weights: a refused checkpoint is never loaded) with changes."""
    dst.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(src / name, dst / name)
    config = json.loads((src / "config.json").read_text())
    config.update(config_changes)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def _refusal(tmp_path, config: dict) -> subprocess.CompletedProcess:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(config))
    proc = marlaas("run", path, "--run-dir", tmp_path / "run", timeout=300)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "local mode" not in proc.stdout and not (tmp_path / "run").exists(), "refused before mpirun"
    return proc


@pytest.mark.parametrize("case", ["model_type", "trainer_tp", "head_dim", "moe_on_cpu_vllm", "missing", "chat_on_tiny"])
def test_checkpoints_the_job_cannot_serve_are_refused_before_mpirun(tmp_path, qwen_path, case):
    import torch

    if case in ("head_dim", "moe_on_cpu_vllm") and torch.cuda.is_available():
        pytest.skip("with CUDA, local vLLM runs on the GPU, which has no such limit")
    config = _small(yaml.safe_load(TWIN.read_text()), "random:qwen3-0.6b-mini")
    expect = {"model_type": ("model:", "config.json model_type: 'mixtral' is a mixture-of-experts model"),
              "trainer_tp": ("layout.trainer_tp:", "8 does not divide num_key_value_heads=4"),
              "head_dim": ("model:", "head_dim 48 is not supported by vLLM's CPU attention"),
              "moe_on_cpu_vllm": ("model:", "a mixture-of-experts model (8 experts) is not served by vLLM on CPU"),
              "missing": ("model:", "is not an HF checkpoint dir"),
              "chat_on_tiny": ("tasks[0].prompt.format:", "need a chat template")}[case]
    if case == "model_type":
        config["model"] = str(_checkpoint_copy(qwen_path, tmp_path / "ckpt", model_type="mixtral", num_local_experts=8))
    elif case == "trainer_tp":
        config["layout"]["trainer_tp"] = 8
    elif case == "head_dim":
        config["model"] = str(_checkpoint_copy(qwen_path, tmp_path / "ckpt", head_dim=48))
    elif case == "moe_on_cpu_vllm":  # served by the `hf` engine on CPU (tests/test_moe_mpi.py)
        config["model"] = "random:qwen3-30b-a3b-mini"
    elif case == "missing":
        config["model"] = str(tmp_path / "not-downloaded-yet")
    else:
        config["model"] = "tiny"
    proc = _refusal(tmp_path, config)
    assert expect[0] in proc.stderr and expect[1] in proc.stderr, proc.stderr
