"""Task data on disk (tasks/dataset_files.py): JSONL, JSON, parquet and `datasets.save_to_disk` folders, the field map,
prompts as text or chat messages (verl's schema), GSM8K / MATH-style answers rewarded by math-verify, and every
bad file or missing column refused at intake naming `dataset.path`, `dataset.fields`, `dataset.split` or
`prompt.format`."""
from __future__ import annotations

import json

import pytest

from marlaas_hpc.env import build_task_data
from marlaas_hpc.model.codec import TextCodec
from marlaas_hpc.tasks import DatasetSpec, SpecError, TaskSpec
from marlaas_hpc.tasks.spec import PromptSpec

GSM8K_ROWS = [{"question": f"Tom has {i} apples and buys {i + 1} more. How many?",
               "answer": f"He has {i}+{i + 1}={2 * i + 1} apples.\n#### {2 * i + 1}"} for i in range(10)]


def _verl_rows(n: int = 8) -> list[dict]:
    """Rows as verl's examples/data_preprocess/gsm8k.py writes them."""
    return [{"data_source": "openai/gsm8k",
             "prompt": [{"role": "user", "content": f"What is {i} + {i}? Let's think step by step and output the "
                                                    "final answer after \"####\"."}],
             "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
             "extra_info": {"split": "train", "index": i}} for i in range(n)]


def _write(rows: list[dict], path, form: str):
    """`rows` written as `form`: jsonl, json, parquet, disk (save_to_disk of a Dataset) or dict (a DatasetDict
    with train and test splits)."""
    import datasets

    datasets.disable_progress_bars()
    if form == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif form == "json":
        path.write_text(json.dumps(rows))
    elif form == "parquet":
        datasets.Dataset.from_list(rows).to_parquet(str(path))
    elif form == "disk":
        datasets.Dataset.from_list(rows).save_to_disk(str(path))
    else:
        datasets.DatasetDict({"train": datasets.Dataset.from_list(rows),
                              "test": datasets.Dataset.from_list(rows[:2])}).save_to_disk(str(path))
    return path


@pytest.mark.parametrize("form, name", [("json", "d.json"), ("parquet", "d.parquet"), ("disk", "saved"),
                                        ("dict", "saved_dict")])
def test_every_format_gives_the_jsonl_samples(tmp_path, form, name):
    reference = build_task_data(DatasetSpec(kind="gsm8k", path=str(_write(GSM8K_ROWS, tmp_path / "d.jsonl", "jsonl")),
                                            eval_size=2))
    task = build_task_data(DatasetSpec(kind="gsm8k", path=str(_write(GSM8K_ROWS, tmp_path / name, form)), eval_size=2))
    assert task.eval_samples() == reference.eval_samples()
    assert [task.train_sample(i) for i in range(12)] == [reference.train_sample(i) for i in range(12)]
    seven = next(s for s in task.eval_samples() + [task.train_sample(i) for i in range(8)] if s.answer == "7")
    assert task.reward(seven, "3+4=7 so\n#### 7") == 1.0 and task.reward(seven, "#### 8") == 0.0


def test_verl_parquet_with_chat_message_prompts_and_nested_answers(tmp_path):
    """verl's parquet: the prompt column is chat messages (rendered by the template as they are, after the task's
    system message), the answer sits in reward_model.ground_truth, the other columns reach sample.meta."""
    from marlaas_hpc.model.random_checkpoints import ensure_random_checkpoint

    path = _write(_verl_rows(), tmp_path / "train.parquet", "parquet")
    spec = DatasetSpec(kind="math", path=str(path), eval_size=2,
                       fields={"prompt": "prompt", "answer": "reward_model.ground_truth"})
    task = build_task_data(spec, "chat")
    sample = task.eval_samples()[0]
    assert isinstance(sample.prompt, tuple) and sample.prompt[0]["role"] == "user"
    number = int(sample.answer)
    assert sample.meta["extra_info"]["index"] == number // 2 and sample.meta["data_source"] == "openai/gsm8k"
    assert task.reward(sample, f"so it is\n#### {number}") == 1.0
    assert task.reward(sample, f"\\boxed{{{number}}}") == 1.0 and task.reward(sample, "#### -1") == 0.0
    codec = TextCodec.from_pretrained(ensure_random_checkpoint("qwen3-0.6b-mini"))
    chat = codec.for_prompt(PromptSpec(format="chat", system="Be brief."))
    assert chat.tokenizer.decode(chat.encode_prompt(sample.prompt)) == (
        f"<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n{sample.prompt[0]['content']}<|im_end|>\n"
        "<|im_start|>assistant\n")
    own = ({"role": "system", "content": "Own."},) + sample.prompt
    assert chat.tokenizer.decode(chat.encode_prompt(own)).startswith("<|im_start|>system\nOwn.<|im_end|>\n<|im_start|>user")
    with pytest.raises(SpecError) as err:
        build_task_data(spec, "raw")
    assert err.value.field == "prompt.format" and "chat messages" in err.value.reason


def test_math_answers_final_boxed_or_after_hashes(tmp_path):
    rows = [{"problem": "Half of one?", "solution": "It is $\\boxed{\\frac{1}{2}}$.", "answer": "\\frac{1}{2}"},
            {"problem": "Two plus two?", "solution": "2+2=4\n#### 4", "answer": "4"},
            {"problem": "Three?", "solution": "three", "answer": 3}]
    path = _write(rows, tmp_path / "math.json", "json")
    by_answer = build_task_data(DatasetSpec(kind="math", path=str(path), eval_size=1))
    by_solution = build_task_data(DatasetSpec(kind="math", path=str(path), eval_size=1, fields={"answer": "solution"}))
    for task in (by_answer, by_solution):
        samples = task.eval_samples() + [task.train_sample(i) for i in range(3)]
        half = next(s for s in samples if "Half" in s.prompt)
        assert half.answer == "\\frac{1}{2}" and task.reward(half, "\\boxed{0.5}") == 1.0
        assert next(s for s in samples if "Two" in s.prompt).answer == "4"
    assert {s.answer for s in by_answer.eval_samples() + [by_answer.train_sample(i) for i in range(3)]} >= {"3"}
    assert by_answer.eval_samples()[0].prompt.startswith("Q: ")  # raw text prompts are worded as GSM8K's


def test_custom_parquet_with_a_field_map_reaches_the_reward_function(tmp_path):
    (tmp_path / "reward.py").write_text(
        "def exact(sample, completion):\n"
        "    assert sample.meta['reward_model']['style'] == 'rule'\n"
        "    assert sample.prompt[0]['role'] == 'user'\n"
        "    return float(completion.strip() == sample.answer)\n")
    path = _write(_verl_rows(), tmp_path / "train.parquet", "parquet")
    spec = DatasetSpec(kind="custom", path=str(path), reward_fn=f"{tmp_path / 'reward.py'}:exact", eval_size=1,
                       fields={"answer": "reward_model.ground_truth"})
    task = build_task_data(spec, "chat")
    sample = task.train_sample(0)
    assert task.reward(sample, f" {sample.answer} ") == 1.0 and task.reward(sample, "no") == 0.0


def _refusal(spec: DatasetSpec, prompt_format: str = "raw") -> SpecError:
    with pytest.raises(SpecError) as err:
        build_task_data(spec, prompt_format)
    return err.value


@pytest.mark.parametrize("form", ["jsonl", "parquet", "disk"])
def test_a_missing_column_is_refused_naming_dataset_fields(tmp_path, form):
    path = _write(_verl_rows(), tmp_path / f"d.{form}", form)
    err = _refusal(DatasetSpec(kind="math", path=str(path), fields={"prompt": "prompt", "answer": "reward_model.gt"}),
                   "chat")
    assert err.field == "dataset.fields" and "no column 'gt' in reward_model" in err.reason
    assert "dataset.fields.answer is 'reward_model.gt'" in err.reason and "'ground_truth'" in err.reason
    err = _refusal(DatasetSpec(kind="gsm8k", path=str(path)), "chat")
    assert err.field == "dataset.fields" and "no column 'question'" in err.reason and "'prompt'" in err.reason


@pytest.mark.parametrize("row, needle", [
    ({"problem": 5, "answer": "1"}, "(the prompt) must be non-empty text or chat messages"),
    ({"problem": [{"role": "robot", "content": "hi"}], "answer": "1"}, "(the prompt) must be"),
    ({"problem": "q", "answer": ["1"]}, "(the answer) must be non-empty text or a number"),
    ({"problem": "q", "answer": " "}, "(the answer) must be"),
])
def test_columns_of_the_wrong_shape_are_refused_naming_dataset_fields(tmp_path, row, needle):
    path = _write([row], tmp_path / "d.jsonl", "jsonl")
    err = _refusal(DatasetSpec(kind="math", path=str(path)))
    assert err.field == "dataset.fields" and needle in err.reason and "d.jsonl:1" in err.reason


@pytest.mark.parametrize("make, needle", [
    (lambda d: (d / "bad.parquet").write_bytes(b"PAR1 not really"), "cannot be read as parquet"),
    (lambda d: (d / "bad.json").write_text("{\"a\": [1, 2"), "cannot be read as json"),
    (lambda d: (d / "bad.csv").write_text("a,b\n"), "unknown data format '.csv'"),
    (lambda d: (d / "bad").mkdir(), "not one `datasets.save_to_disk` wrote"),
])
def test_bad_data_files_are_refused_naming_dataset_path(tmp_path, make, needle):
    make(tmp_path)
    path = next(iter(tmp_path.iterdir()))
    err = _refusal(DatasetSpec(kind="gsm8k", path=str(path)))
    assert err.field == "dataset.path" and needle in err.reason and str(path) in err.reason


def test_a_saved_folder_reaching_outside_itself_is_refused(tmp_path):
    saved = _write(GSM8K_ROWS, tmp_path / "saved", "disk")
    outside = tmp_path / "elsewhere.arrow"
    (saved / "data-00000-of-00001.arrow").rename(outside)
    state = json.loads((saved / "state.json").read_text())
    state["_data_files"] = [{"filename": "../elsewhere.arrow"}]
    (saved / "state.json").write_text(json.dumps(state))
    err = _refusal(DatasetSpec(kind="gsm8k", path=str(saved)))
    assert err.field == "dataset.path" and "outside its folder" in err.reason


def test_a_saved_dataset_dict_naming_a_split_outside_itself_is_refused(tmp_path):
    saved = _write(GSM8K_ROWS, tmp_path / "saved", "dict")
    (saved / "train").rename(tmp_path / "train")
    (saved / "dataset_dict.json").write_text(json.dumps({"splits": ["../train", "test"]}))
    err = _refusal(DatasetSpec(kind="gsm8k", path=str(saved), split="../train"))
    assert err.field == "dataset.path" and "names splits outside its folder: ['../train']" in err.reason


def test_splits_of_a_saved_dataset_dict(tmp_path):
    saved = _write(GSM8K_ROWS, tmp_path / "saved", "dict")
    test = build_task_data(DatasetSpec(kind="gsm8k", path=str(saved), split="test", eval_size=1))
    assert len(test.eval_samples()) == 1 and test.train_sample(0) == test.train_sample(1)  # 2 rows: 1 eval, 1 train
    err = _refusal(DatasetSpec(kind="gsm8k", path=str(saved), split="validation"))
    assert err.field == "dataset.split" and "['test', 'train']" in err.reason
    single = _write(GSM8K_ROWS, tmp_path / "single", "disk")
    assert _refusal(DatasetSpec(kind="gsm8k", path=str(single), split="train")).field == "dataset.split"


@pytest.mark.parametrize("dataset, field, reason", [
    ({"kind": "math", "path": "x.parquet", "fields": {"question": "q"}}, "dataset.fields", "unknown sample part"),
    ({"kind": "math", "path": "x.parquet", "fields": {"prompt": ""}}, "dataset.fields", "must map sample parts"),
    ({"kind": "addition", "fields": {"prompt": "q"}}, "dataset.fields", "applies to kinds"),
    ({"kind": "hotpotqa", "path": "x.jsonl", "split": "train"}, "dataset.split", "applies to kinds"),
    ({"kind": "math"}, "dataset.path", "needs a data file"),
])
def test_bad_dataset_specs_are_refused_by_name(dataset, field, reason):
    with pytest.raises(SpecError) as err:
        TaskSpec.from_dict({"task_id": "t", "dataset": dataset})
    assert err.value.field == field and reason in err.value.reason
