"""The pieces of tools/bench_vs_trl.py: the single-process baseline trains the same task as marlaas (same prompt
stream, eval split, token ids, reward and hyper-parameters), and a task it cannot mirror is refused by name."""
import importlib.util
from pathlib import Path

import pytest

from marlaas_hpc.config import JobConfig
from marlaas_hpc.env import build_task_data
from marlaas_hpc.tasks import TaskSpec

ROOT = Path(__file__).resolve().parents[1]


def _tool(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench():
    return _tool("bench_vs_trl")


@pytest.fixture(scope="module")
def trl_task():
    return _tool("trl_baseline")  # imports nothing of TRL at module level: runs in any venv


def test_payload_is_the_tasks_prompt_stream_and_hyperparameters(bench, tmp_path):
    job = JobConfig.load(str(ROOT / "configs" / "local-demo.yaml")).validate()
    for spec in job.tasks:
        payload = bench.task_payload(spec, "model", tmp_path)
        data = build_task_data(spec.dataset, spec.prompt.format)
        n = spec.total_steps * spec.algo.batch_prompts
        assert payload["train_prompts"] == [data.train_sample(i).prompt for i in range(n)]
        assert payload["train_answers"] == [data.train_sample(i).answer for i in range(n)]
        assert payload["eval_prompts"] == [s.prompt for s in data.eval_samples()]
        assert payload["steps"] == spec.total_steps == 30
        assert (payload["algo"]["group_size"], payload["algo"]["batch_prompts"]) == (8, 8)
        assert payload["algo"]["lr"] == spec.algo.lr and payload["algo"]["max_new_tokens"] == spec.algo.max_new_tokens
        # the objective's values, resolved (unset fields are None in the spec): GRPO's clip and std scaling
        assert (payload["algo"]["clip_eps"], payload["algo"]["clip_eps_high"]) == (0.2, 0.2)
        assert payload["algo"]["normalize_adv_std"] is True
        assert (payload["lora"]["rank"], payload["lora"]["alpha"]) == (spec.lora.rank, spec.lora.alpha)
        assert payload["lora"]["target_modules"] == list(spec.lora.target_modules)
        assert TaskSpec.from_dict(payload["spec"]) == spec  # the LocalDriver fallback trains this very spec


def test_baseline_reward_equals_the_tasks(bench, trl_task, tmp_path):
    job = JobConfig.load(str(ROOT / "configs" / "local-demo.yaml")).validate()
    for spec in job.tasks:
        data = build_task_data(spec.dataset, spec.prompt.format)
        samples = [data.train_sample(i) for i in range(16)]
        completions = [s.answer for s in samples[:4]] + [f" {s.answer} " for s in samples[4:8]] + \
                      [s.meta["mistake"] for s in samples[8:12]] + ["", "x", "1 2", samples[15].answer + "0"]
        expected = [data.reward(s, c) for s, c in zip(samples, completions)]
        got = trl_task.reward_fn([s.prompt for s in samples], completions, [s.answer for s in samples])
        assert got == expected
        assert 0 < sum(expected) < len(expected)  # both outcomes occur: the comparison can fail


def test_baseline_prompt_ids_equal_the_codecs(trl_task, tiny_model_path):
    """TRL tokenizes a plain-text prompt with the tokenizer's defaults (GRPOTrainer._tokenize_prompts); the text
    carries the raw format's bos."""
    from transformers import AutoTokenizer

    from marlaas_hpc.model import TextCodec

    codec = TextCodec.from_pretrained(tiny_model_path)
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_path))  # what TRL loads
    for prompt in ["12+7=", "rev abcd=", "cnt a:abca=", "srt 5312="]:
        text = trl_task.prompt_text(tokenizer, prompt)
        assert tokenizer(text)["input_ids"] == codec.encode_prompt(prompt)
        assert tokenizer(text, add_special_tokens=False)["input_ids"] == codec.encode_prompt(prompt)  # eval


def test_baseline_refuses_a_task_it_cannot_mirror(bench, tmp_path):
    spec = TaskSpec.from_dict({"task_id": "search", "dataset": {"kind": "lookup"}})
    with pytest.raises(ValueError, match="search.*lookup"):
        bench.task_payload(spec, "model", tmp_path)
