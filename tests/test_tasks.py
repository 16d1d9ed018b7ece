"""Task specs, synthetic tasks, file-backed tasks and their verifiers."""
import json
import os
import sys

import pytest

from marlaas_hpc.env import build_task_data
from marlaas_hpc.tasks import SYNTHETIC_KINDS, DatasetSpec, RewardError, SpecError, TaskSpec
from marlaas_hpc.tasks.base import Sample


def _spec(**over):
    data = {"task_id": "t1", "tenant": "alice", "dataset": {"kind": "addition"}}
    data.update(over)
    return data


@pytest.mark.parametrize("data, field", [
    (_spec(dataset={"kind": "juggling"}), "dataset.kind"),
    (_spec(lora={"rank": 0}), "lora.rank"),
    (_spec(lora={"rank": -4}), "lora.rank"),
    (_spec(lora={"target_modules": ["q_proj", "lm_head_proj"]}), "lora.target_modules"),
    (_spec(algo={"group_size": 1}), "algo.group_size"),
    (_spec(algo={"temperature": 0}), "algo.temperature"),
    (_spec(total_steps=0), "total_steps"),
    (_spec(max_staleness=-1), "max_staleness"),
    (_spec(task_id="../evil"), "task_id"),
    (_spec(tenant="a/b"), "tenant"),
    (_spec(colour="blue"), "colour"),
    (_spec(algo={"lr": "fast"}), "algo.lr"),
    (_spec(dataset={"kind": "gsm8k"}), "dataset.path"),
    (_spec(dataset={"kind": "custom", "path": "x.jsonl"}), "dataset.reward_fn"),
    # non-finite and out-of-range numbers (YAML `.nan`, `.inf`) name their field at intake
    (_spec(algo={"lr": float("nan")}), "algo.lr"),
    (_spec(algo={"lr": float("inf")}), "algo.lr"),
    (_spec(algo={"temperature": float("nan")}), "algo.temperature"),
    (_spec(algo={"kl_beta": float("-inf")}), "algo.kl_beta"),
    (_spec(algo={"grad_clip": float("nan")}), "algo.grad_clip"),
    (_spec(algo={"clip_eps": 1.5}), "algo.clip_eps"),
    (_spec(algo={"weight_decay": float("nan")}), "algo.weight_decay"),
    (_spec(lora={"alpha": float("nan")}), "lora.alpha"),
    (_spec(lora={"rank": True}), "lora.rank"),
    (_spec(dataset={"kind": "addition", "tool_latency_s": float("nan")}), "dataset.tool_latency_s"),
    (_spec(dataset={"kind": "addition", "seed": -1}), "dataset.seed"),
    (_spec(dataset={"kind": "addition", "eval_size": 10**12}), "dataset.eval_size"),
    (_spec(total_steps=10**12), "total_steps"),
    (_spec(priority=2**70), "priority"),
    (_spec(algo={"group_size": 10**9}), "algo.group_size"),
])
def test_bad_spec_names_field(data, field):
    with pytest.raises(SpecError) as err:
        TaskSpec.from_dict(data)
    assert err.value.field == field
    assert str(err.value).startswith(field + ":")


def test_good_spec_roundtrip():
    spec = TaskSpec.from_dict(_spec(lora={"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]},
                                    algo={"group_size": 4, "lr": 1}))
    assert spec.lora.scaling == 2.0 and spec.lora.target_modules == ("q_proj", "v_proj")
    assert TaskSpec.from_dict(spec.to_dict()) == spec


@pytest.mark.parametrize("kind", SYNTHETIC_KINDS)
def test_synthetic_split_is_seeded_and_disjoint(kind):
    a = build_task_data(DatasetSpec(kind=kind, seed=3, eval_size=50))
    b = build_task_data(DatasetSpec(kind=kind, seed=3, eval_size=50))
    assert a.eval_samples() == b.eval_samples()
    assert [a.train_sample(i) for i in range(20)] == [b.train_sample(i) for i in range(20)]
    eval_prompts = {s.prompt for s in a.eval_samples()}
    assert not eval_prompts & {a.train_sample(i).prompt for i in range(500)}
    sample = a.train_sample(7)
    assert a.reward(sample, sample.answer) == 1.0
    assert a.reward(sample, " " + sample.answer + "\n") == 1.0
    assert a.reward(sample, sample.answer + "0") == 0.0
    # the systematic mistake is right on only part of the inputs (so the pre-trained model is imperfect)
    agree = sum(s.answer == s.meta["mistake"] for s in a.eval_samples()) / 50
    assert 0.05 <= agree <= 0.6


def _write_gsm8k(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_gsm8k_loader_and_math_verify_reward(tmp_path):
    rows = [{"question": f"Tom has {i} apples and buys {i + 1} more. How many?",
             "answer": f"He has {i}+{i + 1}={2 * i + 1} apples.\n#### {2 * i + 1}"} for i in range(10)]
    rows.append({"question": "Half of 3?", "answer": "3/2 = 1.5\n#### 1.5"})
    path = tmp_path / "gsm8k.jsonl"
    _write_gsm8k(path, rows)
    task = build_task_data(DatasetSpec(kind="gsm8k", path=str(path), eval_size=2))
    assert len(task.eval_samples()) == 2
    samples = task.eval_samples() + [task.train_sample(i) for i in range(9)]
    assert {s.index for s in samples} == set(range(11))
    half = next(s for s in samples if s.answer == "1.5")
    assert task.reward(half, "The answer is 3/2") == 1.0
    assert task.reward(half, "#### 1.50") == 1.0
    assert task.reward(half, "#### 2") == 0.0
    seven = next(s for s in samples if s.answer == "7")
    assert task.reward(seven, "3+4=7 so\n#### 7") == 1.0
    assert task.reward(seven, "I don't know") == 0.0


@pytest.mark.parametrize("content, field, needle", [
    (None, "dataset.path", "not found"),
    ('{"question": "q", "answer": "#### 1"}\nnot json\n', "dataset.path", ":2: malformed JSON"),
    ('{"question": "q"}\n', "dataset.fields", ":1: no column 'answer'"),
    ('{"question": "q", "answer": "no final"}\n', "dataset.path", "no '#### N'"),
    ("", "dataset.path", "no samples"),
    (b"\xff\xfe\x00bad", "dataset.path", "not UTF-8"),
])
def test_gsm8k_bad_files_name_file_and_line(tmp_path, content, field, needle):
    path = tmp_path / "bad.jsonl"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    with pytest.raises(SpecError) as err:
        build_task_data(DatasetSpec(kind="gsm8k", path=str(path)))
    assert err.value.field == field and needle in str(err.value) and "bad.jsonl" in str(err.value)


def test_custom_dataset_and_reward_file(tmp_path):
    """A reward function given as FILE.py:FUNCTION (no PYTHONPATH): never imported here, it runs in a sandboxed
    worker process and sees the sample's fields; its failures come back as RewardError."""
    (tmp_path / "my_reward.py").write_text(
        "import os\n"
        "def partial(sample, completion):\n"
        "    assert os.getpid() != %d, 'runs in its own process'\n"
        "    return sum(a == b for a, b in zip(sample.answer, completion)) / len(sample.answer)\n"
        "def broken(sample, completion):\n    raise ZeroDivisionError('oops')\n"
        "def nan(sample, completion):\n    return float('nan')\n"
        "def words(sample, completion):\n    return 'high'\n" % os.getpid())
    data = tmp_path / "mine.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"p{i}", "answer": "abcd", "level": i}) + "\n" for i in range(6)))
    reward = f"{tmp_path / 'my_reward.py'}:partial"
    task = build_task_data(DatasetSpec(kind="custom", path=str(data), reward_fn=reward, eval_size=1))
    assert "my_reward" not in sys.modules
    sample = task.train_sample(0)
    assert sample.meta["level"] in range(6)
    assert task.reward(sample, "abzz") == 0.5
    for name, message in (("broken", "ZeroDivisionError: oops"), ("nan", r"outside \[0, 1\]"),
                          ("words", "not a number")):
        bad = build_task_data(DatasetSpec(kind="custom", path=str(data), reward_fn=reward.replace("partial", name)))
        with pytest.raises(RewardError, match=message):
            bad.reward(sample, "abcd")
    missing = build_task_data(DatasetSpec(kind="custom", path=str(data), reward_fn=reward.replace("partial", "x")))
    with pytest.raises(RewardError, match="has no function 'x'"):
        missing.reward(sample, "abcd")
    with pytest.raises(SpecError, match="names a module") as err:
        build_task_data(DatasetSpec(kind="custom", path=str(data), reward_fn="my_reward:partial"))
    assert err.value.field == "dataset.reward_fn"


def test_sample_meta_does_not_affect_equality():
    assert Sample(1, "p", "a", {"x": 1}) == Sample(1, "p", "a", {"x": 2})


def test_nan_in_a_yaml_spec_is_refused_naming_the_field():
    import yaml

    data = yaml.safe_load("task_id: t1\ndataset: {kind: addition}\nalgo: {lr: .nan}\n")
    with pytest.raises(SpecError) as err:
        TaskSpec.from_dict(data)
    assert err.value.field == "algo.lr" and "finite" in str(err.value)
