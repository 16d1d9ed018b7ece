"""The project's byte-level BPE tokenizers with the traits of real model families' vocabularies, built locally.

One BPE (4,096 tokens, trained here with `tokenizers` on generated English-like text, arithmetic and GSM8K-style
stories) dressed in each family's vocabulary:

- Qwen (Qwen2 / Qwen2.5 / Qwen3): 151,936 embedding rows for 151,669 tokenizer tokens; reserved fillers up to
  151,643, then Qwen's 26 added tokens at Qwen's ids (`<|endoftext|>` 151643, `<|im_start|>` 151644,
  `<|im_end|>` 151645, ...); no bos; eos `<|im_end|>`, pad `<|endoftext|>`; digits split one by one (Qwen's
  pre-tokenizer regex); ChatML chat templates (Qwen3's with `enable_thinking`, Qwen2.5's with its default
  system message).
- Llama 3: 128,256 rows = tokenizer tokens; fillers up to 128,000, then the 256 special tokens at Llama's ids
  (`<|begin_of_text|>` 128000, `<|end_of_text|>` 128001, `<|start_header_id|>` 128006, `<|eom_id|>` 128008,
  `<|eot_id|>` 128009, ...); bos `<|begin_of_text|>` (added by the post-processor, as Llama's tokenizer does),
  eos `<|eot_id|>`, no pad; numbers split in runs of up to three digits; Llama 3.1's chat template (bos, a
  system header with the knowledge-cutoff lines, tool output as an `ipython` turn).

Each vocabulary also carries the eos list of its Instruct checkpoints' generation_config.json.
Fillers are never produced by a merge: their ids exist only so the special tokens land on the real ids.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

# ---------------------------------------------------------------------------------------------- Qwen
QWEN_VOCAB_ROWS = 151936
QWEN_FIRST_SPECIAL_ID = 151643
QWEN_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                       "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
                       "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
                       "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
                       "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>")
"""Qwen3's added tokens in Qwen3's order, so each lands on its Qwen3 id (151643 ...); Qwen2.5 has the first 22."""
ENDOFTEXT_ID, IM_START_ID, IM_END_ID = 151643, 151644, 151645
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
              r"|\s+(?!\S)|\s+")
"""Qwen2's pre-tokenizer regex: single digits."""

_TOOL_TURN = "{{ '<|im_start|>user\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' }}"

# Qwen-style ChatML: system / user / assistant turns, tool output as a user turn in <tool_response>, and
# `enable_thinking=False` pre-filling an empty think block (as Qwen3's own template does).
QWEN3_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'tool' -%}" + _TOOL_TURN +
    "{%- else -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif -%}"
    "{%- endif -%}")

# Qwen2.5-Instruct's ChatML: a default system message when the conversation has none; no thinking.
QWEN2_CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] != 'system' -%}"
    "{{ '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'tool' -%}" + _TOOL_TURN +
    "{%- else -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}")

# ---------------------------------------------------------------------------------------------- Llama 3
LLAMA3_VOCAB_ROWS = 128256
LLAMA3_FIRST_SPECIAL_ID = 128000
LLAMA3_SPECIAL_TOKENS = (("<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                          "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|reserved_special_token_2|>",
                          "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>")
                         + tuple(f"<|reserved_special_token_{i}|>" for i in range(3, 248)))
"""Llama 3.1's 256 special tokens in Llama's order (128000 ... 128255)."""
BEGIN_OF_TEXT_ID, END_OF_TEXT_ID, EOM_ID, EOT_ID = 128000, 128001, 128008, 128009
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
"""Llama 3's pre-tokenizer regex: numbers in runs of up to three digits."""

# Llama 3.1-Instruct's template, without its tool-definition blocks: bos, a system header that always carries the
# knowledge-cutoff lines, turns closed by <|eot_id|>, tool output as an ipython turn.
LLAMA3_CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- set system_message = messages[0]['content'] | trim %}{%- set messages = messages[1:] %}"
    "{%- else %}{%- set system_message = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{{- 'Cutting Knowledge Date: December 2023\\nToday Date: 26 Jul 2024\\n\\n' }}"
    "{{- system_message + '<|eot_id|>' }}"
    "{%- for message in messages %}"
    "{%- if message['role'] in ('tool', 'ipython') %}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message['content'] + '<|eot_id|>' }}"
    "{%- else %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")


@dataclass(frozen=True)
class Vocabulary:
    name: str
    """Which family's vocabulary this imitates."""
    rows: int
    """Embedding rows of the family's checkpoints (config.json vocab_size)."""
    first_special_id: int
    """Id of the first special token; BPE tokens and fillers below it."""
    special_tokens: tuple[str, ...]
    """Special tokens, at first_special_id onwards."""
    bos: str | None
    """Begin-of-sequence token (None: the family has none)."""
    eos: str
    """The tokenizer's eos (an Instruct model's end of turn)."""
    pad: str | None
    """Padding token (None: the family has none)."""
    generation_eos: tuple[str, ...]
    """eos_token_id list of the Instruct checkpoints' generation_config.json."""
    split_pattern: str
    """Pre-tokenizer regex (how digits and words are cut before BPE)."""
    chat_template: str
    """Jinja chat template."""

    def token_id(self, token: str) -> int:
        return self.first_special_id + self.special_tokens.index(token)


QWEN3 = Vocabulary("qwen3", QWEN_VOCAB_ROWS, QWEN_FIRST_SPECIAL_ID, QWEN_SPECIAL_TOKENS, None, "<|im_end|>",
                   "<|endoftext|>", ("<|im_end|>", "<|endoftext|>"), QWEN_SPLIT, QWEN3_CHAT_TEMPLATE)
QWEN2 = Vocabulary("qwen2", QWEN_VOCAB_ROWS, QWEN_FIRST_SPECIAL_ID, QWEN_SPECIAL_TOKENS[:22], None, "<|im_end|>",
                   "<|endoftext|>", ("<|im_end|>", "<|endoftext|>"), QWEN_SPLIT, QWEN2_CHAT_TEMPLATE)
LLAMA3 = Vocabulary("llama3", LLAMA3_VOCAB_ROWS, LLAMA3_FIRST_SPECIAL_ID, LLAMA3_SPECIAL_TOKENS, "<|begin_of_text|>",
                    "<|eot_id|>", None, ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"), LLAMA3_SPLIT,
                    LLAMA3_CHAT_TEMPLATE)
VOCABULARIES = {v.name: v for v in (QWEN3, QWEN2, LLAMA3)}

# ---------------------------------------------------------------------------------------------- BPE
_WORDS = ("the a an of to and in is was for on with as by at from that this it he she they we you his her "
          "their our how many much more less than each every total altogether left remaining after before then "
          "per day week month year hour minute dollar dollars cent cents apple apples book books friend friends "
          "bought sold gave received spent earned saved paid costs cost has had have buys sells shares twice "
          "half third quarter times number numbers answer question step steps first second next finally so "
          "Natalia James Maria John Sarah Tom Anna Leo Mia Ben store school garden farm car train bus miles "
          "eggs cookies pencils marbles tickets boxes bags cups pages students teachers workers children "
          "solve reason explain final put within boxed think tool search result calculator please assistant "
          "user system you are helpful two three four five six seven eight nine ten holds found puts had").split()
BPE_SIZE = 4096
"""Tokens the BPE learns (bytes and merges) below the fillers."""


def bpe_corpus(lines: int = 3000, stories: int = 3000) -> list[str]:
    """Deterministic training text: English-like lines with arithmetic, and GSM8K-style stories with their
    worked solutions and the chat instructions (the text the GSM8K tasks put in prompts and completions)."""
    from marlaas_hpc.tasks.gsm8k import INSTRUCTIONS, synthetic_gsm8k

    rng = random.Random(1234)
    out = []
    for i in range(lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randrange(6, 20))]
        a, b = rng.randrange(1, 1000), rng.randrange(1, 100)
        out.append(" ".join(words) + f" {a} + {b} = {a + b}. {a} * {b} = {a * b}, #### {a - b}\n"
                   + ("\\boxed{" + str(a) + "}" if i % 3 == 0 else "Q: A:"))
    story_rng = random.Random("bpe-stories")
    for i in range(stories):
        question, answer, meta = synthetic_gsm8k(story_rng)
        out.append(f"{question}\n{INSTRUCTIONS[(None, 'hash', 'boxed')[i % 3]]}\n{meta['solution']}")
    return out


def build_tokenizer(vocab: Vocabulary):
    """A PreTrainedTokenizerFast with the family's ids, special tokens, pre-tokenizer and chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(vocab.split_pattern), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=BPE_SIZE, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    core.train_from_iterator(bpe_corpus(), trainer=trainer)
    data = json.loads(core.to_str())
    table = data["model"]["vocab"]
    for i in range(len(table), vocab.first_special_id):
        table[f"<|reserved_{i}|>"] = i
    core = Tokenizer.from_str(json.dumps(data))
    core.add_special_tokens(list(vocab.special_tokens))
    if vocab.bos is not None:  # the tokenizer puts bos first when asked for special tokens, as Llama's does
        bos_id = vocab.token_id(vocab.bos)
        core.post_processor = processors.TemplateProcessing(single=f"{vocab.bos} $A", pair=f"{vocab.bos} $A $B",
                                                            special_tokens=[(vocab.bos, bos_id)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, bos_token=vocab.bos, eos_token=vocab.eos,
                                        pad_token=vocab.pad, clean_up_tokenization_spaces=False)
    tokenizer.chat_template = vocab.chat_template
    assert tokenizer.convert_tokens_to_ids(vocab.eos) == vocab.token_id(vocab.eos)
    return tokenizer


def save_tokenizer(vocab: Vocabulary, out_dir: str | Path) -> None:
    """Writes the family's tokenizer files. tokenizer_config.json says `unk_token: null`, as the released ones
    do: transformers builds Qwen2Tokenizer for a qwen2 checkpoint whatever the file names, and that class would
    otherwise default its unk token to <|endoftext|>."""
    build_tokenizer(vocab).save_pretrained(str(out_dir))
    path = Path(out_dir) / "tokenizer_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "unk_token": None}, indent=2))
