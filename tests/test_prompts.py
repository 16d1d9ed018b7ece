"""Prompt formats and stopping on a real-shaped tokenizer: raw and chat prompts, tool turns in chat episodes,
every eos id of the checkpoint, GSM8K in chat form with '####' or \\boxed{} answers, and the refusals."""
from __future__ import annotations

import json

import pytest

from marlaas_hpc.model.codec import TextCodec
from marlaas_hpc.model.random_checkpoints import ENDOFTEXT_ID, IM_END_ID, IM_START_ID
from marlaas_hpc.env import build_task_data
from marlaas_hpc.tasks import DatasetSpec, SpecError, TaskSpec
from marlaas_hpc.tasks.gsm8k import final_answer, math_verify_reward
from marlaas_hpc.tasks.spec import PromptSpec


@pytest.fixture(scope="module")
def codec(qwen_path):
    return TextCodec.from_pretrained(qwen_path)


def test_random_checkpoint_has_the_real_qwen3_traits(qwen_path, codec):
    from marlaas_hpc.model.random_checkpoints import ensure_random_checkpoint

    config = json.loads((qwen_path / "config.json").read_text())
    assert config["vocab_size"] == 151936 and config["tie_word_embeddings"] is True
    assert config["num_key_value_heads"] < config["num_attention_heads"]  # GQA
    assert config["head_dim"] >= 32 and config["head_dim"] != config["hidden_size"] // config["num_attention_heads"]
    untied = json.loads((ensure_random_checkpoint("qwen3-8b-mini") / "config.json").read_text())
    assert untied["tie_word_embeddings"] is False and untied["vocab_size"] == 151936
    from safetensors import safe_open

    with safe_open(str(qwen_path / "model.safetensors"), "pt") as weights:
        names = set(weights.keys())
    assert "model.layers.0.self_attn.q_norm.weight" in names and "lm_head.weight" not in names  # qk-norm, tied
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(qwen_path))  # as transformers (and vLLM) load it
    assert len(tok) < config["vocab_size"]  # the embedding has more rows than the tokenizer has tokens
    assert (tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
            == [ENDOFTEXT_ID, IM_START_ID, IM_END_ID])
    assert tok.backend_tokenizer.model.__class__.__name__ == "BPE"
    assert len(tok.encode("Natalia sold clips to 48 of her friends", add_special_tokens=False)) < 20  # merges
    assert codec.stop_ids == [IM_END_ID, ENDOFTEXT_ID]  # tokenizer eos first, then generation_config.json's


def test_raw_and_chat_prompts(codec):
    raw = codec.encode_prompt("What is 2+3?")
    assert raw == codec.tokenizer.encode("What is 2+3?", add_special_tokens=False)  # Qwen3 has no bos
    chat = codec.for_prompt(PromptSpec(format="chat", system="Be brief.",
                                       template_kwargs={"enable_thinking": False}))
    ids = chat.encode_prompt("What is 2+3?")
    assert chat.tokenizer.decode(ids) == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+3?"
                                          "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert ids[0] == IM_START_ID and ids.count(IM_END_ID) == 2  # special tokens as single ids
    plain = codec.for_prompt(PromptSpec(format="chat"))
    assert plain.tokenizer.decode(plain.encode_prompt("hi")) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert codec.for_prompt(PromptSpec(format="chat")) is plain  # cached per format


def test_completions_end_at_the_first_stop_id(codec):
    hello = codec.tokenizer.encode("hello there", add_special_tokens=False)
    after = codec.tokenizer.encode(" never seen", add_special_tokens=False)
    for stop in (IM_END_ID, ENDOFTEXT_ID):
        assert codec.decode_completion(hello + [stop] + after) == "hello there"
    assert codec.decode_completion(hello) == "hello there"


def test_chat_tool_output_becomes_a_tool_turn(codec):
    chat = codec.for_prompt(PromptSpec(format="chat"))
    turn = codec.tokenizer.encode("<tool>", add_special_tokens=False) + [IM_END_ID]
    obs = chat.encode_observation("42", turn)
    assert chat.tokenizer.decode(obs) == ("\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n"
                                          "<|im_start|>assistant\n")
    cut = chat.encode_observation("42", turn[:-1])  # a turn cut off by its token cap is closed first
    assert cut == [IM_END_ID] + obs
    assert codec.encode_observation("42", turn) == codec.tokenizer.encode("42", add_special_tokens=False)  # raw


def test_chat_needs_a_chat_template():
    from marlaas_hpc.model.tokenizer import build_char_tokenizer

    char = TextCodec(build_char_tokenizer())
    with pytest.raises(ValueError, match="chat template"):
        char.for_prompt(PromptSpec(format="chat"))


@pytest.mark.parametrize("bad, field", [
    ({"prompt": {"format": "markdown"}}, "prompt.format"),
    ({"prompt": {"system": "hi"}}, "prompt.system"),  # raw prompts have no system message
    ({"prompt": {"format": "chat", "template_kwargs": {"x": [1]}}}, "prompt.template_kwargs"),
    ({"prompt": {"format": "chat", "sytem": "typo"}}, "prompt.sytem"),
    ({"dataset": {"kind": "gsm8k_synth", "answer_format": "latex"}}, "dataset.answer_format"),
])
def test_bad_prompt_fields_are_refused_by_name(bad, field):
    with pytest.raises(SpecError) as info:
        TaskSpec.from_dict({"task_id": "t", **bad})
    assert info.value.field == field


def test_gsm8k_chat_prompts_carry_the_instruction_and_answer_form():
    raw = build_task_data(DatasetSpec(kind="gsm8k_synth", seed=3, eval_size=8), "raw")
    chat = build_task_data(DatasetSpec(kind="gsm8k_synth", seed=3, eval_size=8, answer_format="boxed"), "chat")
    r, c = raw.eval_samples()[0], chat.eval_samples()[0]
    assert r.meta["question"] == c.meta["question"] and r.answer == c.answer  # same problem, other wording
    assert r.prompt == f"Q: {r.meta['question']}\nA:"
    assert c.prompt.startswith(c.meta["question"]) and "\\boxed{}" in c.prompt
    other_seed = build_task_data(DatasetSpec(kind="gsm8k_synth", seed=4, eval_size=8), "raw")
    assert other_seed.eval_samples()[0].meta["question"] != r.meta["question"]
    assert r.meta["solution"].endswith(f"#### {r.answer}")
    assert raw.reward(r, r.meta["solution"]) == 1.0  # the worked solution scores
    assert {raw.train_sample(i).prompt for i in range(200)}.isdisjoint({s.prompt for s in raw.eval_samples()})


@pytest.mark.parametrize("completion, answer_format, reward", [
    ("3 + 4 = 7.\n#### 7", None, 1.0),
    ("so the answer is \\boxed{7}", None, 1.0),
    ("The answer is 7", None, 1.0),  # lenient: base models in raw form
    ("#### 8", None, 0.0),
    ("so \\boxed{7}", "hash", 0.0),  # strict variants need their own form
    ("#### 7", "hash", 1.0),
    ("#### 7", "boxed", 0.0),
    ("\\boxed{\\frac{14}{2}}", "boxed", 1.0),
])
def test_gsm8k_answer_forms_by_math_verify(completion, answer_format, reward):
    assert math_verify_reward("7", completion, answer_format) == reward


def test_a_reward_off_the_main_thread_writes_no_warning():
    """Env pool threads call math-verify with its SIGALRM timeouts off (the pool bounds the call): its warning that
    they are off, once per process, was the one stray line of a GSM8K job's output. A fresh process, since the
    warning shows once."""
    import subprocess
    import sys

    script = ("import threading\nfrom marlaas_hpc.tasks.gsm8k import math_verify_reward\nout = []\n"
              "thread = threading.Thread(target=lambda: out.append(math_verify_reward('7', '#### 7', 'hash')))\n"
              "thread.start(); thread.join(); print(out)")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "[1.0]", proc.stdout + proc.stderr
    assert proc.stderr == "", proc.stderr


def test_final_answer_takes_the_last_balanced_box():
    assert final_answer("\\boxed{1} then \\boxed{\\frac{1}{2}}", "boxed") == "\\frac{1}{2}"
    assert final_answer("\\boxed{unclosed", "boxed") is None


def test_gsm8k_tasks_pickle_for_process_pools():
    import pickle

    task = build_task_data(DatasetSpec(kind="gsm8k_synth", seed=1, eval_size=4, answer_format="hash"), "chat")
    copy = pickle.loads(pickle.dumps(task))
    assert copy.train_sample(7) == task.train_sample(7) and copy.answer_format == "hash"


@pytest.mark.parametrize("checkpoint", ["tiny", "qwen3-0.6b-mini", "qwen2.5-0.5b-mini", "llama3.2-1b-mini"])
def test_tokenizer_file_equals_transformers(checkpoint, tiny_model_path):
    """TextCodec reads plain tokenizer.json tokenizers without transformers (model/tokenizer_file.py): the same
    ids, text and chat renderings as AutoTokenizer (which builds Qwen2Tokenizer for a qwen2 checkpoint), special
    tokens, bos and tool turns included."""
    from transformers import AutoTokenizer

    from marlaas_hpc.model.random_checkpoints import ensure_random_checkpoint
    from marlaas_hpc.model.tokenizer_file import TokenizerFile, load_tokenizer

    path = ensure_random_checkpoint(checkpoint) if checkpoint != "tiny" else tiny_model_path
    mine, theirs = load_tokenizer(path), AutoTokenizer.from_pretrained(str(path))
    assert isinstance(mine, TokenizerFile)
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        assert getattr(mine, name) == getattr(theirs, name), name
    assert mine.special_tokens_map == theirs.special_tokens_map
    texts = ["What is 2+3?", "  Natalia sold clips to 48 of her friends,\n\tthen 12 more! ", "1+2=3", "", "ü → ∑"]
    if checkpoint != "tiny":
        texts += ["<|im_start|>user\nhi<|im_end|>\n<think>\n</think>", "don't stop .", "12345 + 6789 = 19134",
                  "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"]
    for text in texts:
        ids = mine.encode(text, add_special_tokens=False)
        assert ids == theirs.encode(text, add_special_tokens=False), text
        assert mine.encode(text) == theirs.encode(text), text  # with special tokens: Llama's bos
        for skip in (False, True):
            assert mine.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
    if checkpoint == "tiny":
        assert mine.chat_template is None and theirs.chat_template is None
        return
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+3?"},
                    {"role": "assistant", "content": "<think>\nadd\n</think>\n\n5"},
                    {"role": "tool", "content": "{\"result\": 5}"}, {"role": "user", "content": "and 4?"}]
    for messages in (conversation[1:2], conversation[:2], conversation):
        for generation in (False, True):
            for kwargs in ({}, {"enable_thinking": False}, {"enable_thinking": True}):
                want = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation, **kwargs)
                assert mine.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation,
                                                **kwargs) == want


def test_tokenizers_transformers_builds_its_own_way_stay_with_autotokenizer(qwen_path, tmp_path):
    """A downloaded Qwen3's tokenizer_config.json names Qwen2Tokenizer: transformers builds that class itself,
    so TextCodec keeps AutoTokenizer for it rather than assume tokenizer.json alone gives the same ids."""
    import shutil

    from marlaas_hpc.model.tokenizer_file import TokenizerFile, load_tokenizer

    for name in ("tokenizer.json", "chat_template.jinja"):
        shutil.copy(qwen_path / name, tmp_path / name)
    config = json.loads((qwen_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "Qwen2Tokenizer"}))
    assert not isinstance(load_tokenizer(tmp_path), TokenizerFile)
    assert isinstance(load_tokenizer(qwen_path), TokenizerFile)


def test_llama3_prompts_stops_and_tool_turns():
    """Llama 3.x: a bos first in raw and chat prompts, the header-framed chat template, <|eot_id|> and the
    generation config's <|end_of_text|> and <|eom_id|> as stops, tool output as an ipython turn."""
    from marlaas_hpc.model.random_checkpoints import ensure_random_checkpoint
    from marlaas_hpc.model.vocabularies import BEGIN_OF_TEXT_ID, END_OF_TEXT_ID, EOM_ID, EOT_ID

    codec = TextCodec.from_pretrained(ensure_random_checkpoint("llama3.2-1b-mini"))
    assert codec.bos_id == BEGIN_OF_TEXT_ID and codec.stop_ids == [EOT_ID, END_OF_TEXT_ID, EOM_ID]
    raw = codec.encode_prompt("What is 2+3?")
    assert raw[0] == BEGIN_OF_TEXT_ID and raw[1:] == codec.tokenizer.encode("What is 2+3?", add_special_tokens=False)
    chat = codec.for_prompt(PromptSpec(format="chat", system="Be brief."))
    ids = chat.encode_prompt("What is 2+3?")
    assert ids.count(BEGIN_OF_TEXT_ID) == 1 and ids[0] == BEGIN_OF_TEXT_ID
    assert chat.tokenizer.decode(ids) == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\n"
        "Today Date: 26 Jul 2024\n\nBe brief.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nWhat is 2+3?"
        "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
    hello = codec.tokenizer.encode("hello", add_special_tokens=False)
    assert all(codec.decode_completion(hello + [stop] + hello) == "hello" for stop in codec.stop_ids)
    turn = codec.tokenizer.encode("<tool>", add_special_tokens=False) + [EOT_ID]
    assert chat.tokenizer.decode(chat.encode_observation("42", turn)) == (
        "<|start_header_id|>ipython<|end_header_id|>\n\n42<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")


def test_qwen25_chat_prompts_get_its_default_system_message():
    from marlaas_hpc.model.random_checkpoints import ensure_random_checkpoint

    codec = TextCodec.from_pretrained(ensure_random_checkpoint("qwen2.5-0.5b-mini"))
    assert codec.bos_id is None and codec.stop_ids == [IM_END_ID, ENDOFTEXT_ID]
    plain = codec.for_prompt(PromptSpec(format="chat"))
    assert plain.tokenizer.decode(plain.encode_prompt("hi")) == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    own = codec.for_prompt(PromptSpec(format="chat", system="Be brief."))
    assert own.tokenizer.decode(own.encode_prompt("hi")).startswith("<|im_start|>system\nBe brief.<|im_end|>")
    turn = codec.tokenizer.encode("x", add_special_tokens=False) + [IM_END_ID]
    assert plain.tokenizer.decode(plain.encode_observation("42", turn)) == (
        "\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
