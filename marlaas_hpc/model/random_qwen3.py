"""Random-weight checkpoints with the traits of real Qwen3 models, built locally (nothing is downloaded).

The project's tiny model has a 128-char vocabulary and untied embeddings; real Qwen3 checkpoints differ in
every way that breaks code written only for it. These checkpoints keep the real traits and shrink the rest:

- vocabulary 151,936 (the model's rows outnumber the tokenizer's 151,6xx tokens, as in Qwen3), which no TP
  size above 1 divides into megatron's 128-row multiples: the trainer must pad it;
- tied input/output embeddings (Qwen3-0.6B / 1.7B / 4B) or untied ones (Qwen3-8B and up);
- grouped-query attention, qk-norm, head_dim decoupled from hidden_size / heads;
- a byte-level BPE tokenizer trained here with `tokenizers`, Qwen's special tokens at Qwen's ids
  (`<|endoftext|>` 151643, `<|im_start|>` 151644, `<|im_end|>` 151645, ...), a chat template, and
  generation_config.json with a list of eos ids and sampling defaults (which the rollout engines must ignore).

Shapes: `qwen3-0.6b` is the full Qwen3-0.6B shape (28 layers, ~0.6B parameters: benchmarks only); `qwen3-8b` the
full Qwen3-8B shape (its published dims), for `marlaas plan` and the GPU dry run, which read config.json only
(`write_config`; its random weights would take 33 GB);
`qwen3-0.6b-mini` (tied) and `qwen3-8b-mini` (untied) keep vocabulary, GQA ratio, head_dim >= 32 and
qk-norm at a width and depth that tests can afford on two CPU cores.

Jobs name them `model: random:<shape>` (built once into the cache, like `tiny`); weights are random, so they
test plumbing and numerics, not learning.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

RANDOM_PREFIX = "random:"
"""`JobConfig.model` prefix naming one of SHAPES, e.g. 'random:qwen3-0.6b-mini'."""

QWEN3_VOCAB = 151936
FIRST_SPECIAL_ID = 151643
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                  "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
                  "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
                  "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
                  "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>")
"""Qwen3's added tokens in Qwen3's order, so each lands on its Qwen3 id (151643 ...)."""
ENDOFTEXT_ID, IM_START_ID, IM_END_ID = 151643, 151644, 151645

# Qwen-style ChatML: system / user / assistant turns, tool output as a user turn in <tool_response>, and
# `enable_thinking=False` pre-filling an empty think block (as Qwen3's own template does).
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'tool' -%}"
    "{{ '<|im_start|>user\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif -%}"
    "{%- endif -%}")


@dataclass(frozen=True, kw_only=True)
class Qwen3Shape:
    hidden_size: int
    """Model width."""
    num_layers: int
    """Decoder layers."""
    num_heads: int
    """Query heads."""
    num_kv_heads: int
    """Key/value heads (GQA)."""
    head_dim: int
    """Per-head width (Qwen3 decouples it from hidden_size / num_heads)."""
    intermediate_size: int
    """SwiGLU hidden width."""
    tied: bool
    """Tied input/output embeddings (Qwen3-0.6B/1.7B/4B) or a separate lm_head (8B and up)."""
    vocab_size: int = QWEN3_VOCAB
    """Embedding rows (Qwen3: 151,936 for ~151,669 tokenizer tokens)."""
    max_position_embeddings: int = 40960
    """Context length in config.json."""
    rope_theta: float = 1_000_000.0
    """RoPE base."""


SHAPES = {
    "qwen3-0.6b": Qwen3Shape(hidden_size=1024, num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128,
                             intermediate_size=3072, tied=True),
    "qwen3-8b": Qwen3Shape(hidden_size=4096, num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128,
                           intermediate_size=12288, tied=False),
    "qwen3-0.6b-mini": Qwen3Shape(hidden_size=128, num_layers=2, num_heads=8, num_kv_heads=4, head_dim=64,
                                  intermediate_size=256, tied=True, max_position_embeddings=4096),
    "qwen3-8b-mini": Qwen3Shape(hidden_size=128, num_layers=2, num_heads=8, num_kv_heads=4, head_dim=64,
                                intermediate_size=320, tied=False, max_position_embeddings=4096),
}


# ---------------------------------------------------------------------------------------------- tokenizer
_WORDS = ("the a an of to and in is was for on with as by at from that this it he she they we you his her "
          "their our how many much more less than each every total altogether left remaining after before then "
          "per day week month year hour minute dollar dollars cent cents apple apples book books friend friends "
          "bought sold gave received spent earned saved paid costs cost has had have buys sells shares twice "
          "half third quarter times number numbers answer question step steps first second next finally so "
          "Natalia James Maria John Sarah Tom Anna Leo Mia Ben store school garden farm car train bus miles "
          "eggs cookies pencils marbles tickets boxes bags cups pages students teachers workers children "
          "solve reason explain final put within boxed think tool search result calculator please assistant "
          "user system you are helpful").split()


def _corpus(lines: int = 3000) -> list[str]:
    """Deterministic English-like text with numbers and arithmetic, the kind of text the tasks produce."""
    import random

    rng = random.Random(1234)
    out = []
    for i in range(lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randrange(6, 20))]
        a, b = rng.randrange(1, 1000), rng.randrange(1, 100)
        out.append(" ".join(words) + f" {a} + {b} = {a + b}. {a} * {b} = {a * b}, #### {a - b}\n"
                   + ("\\boxed{" + str(a) + "}" if i % 3 == 0 else "Q: A:"))
    return out


def build_bpe_tokenizer(bpe_vocab: int = 4096):
    """A byte-level BPE trained on local text; reserved fillers up to 151643; Qwen's special tokens there."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=bpe_vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    core.train_from_iterator(_corpus(), trainer=trainer)
    data = json.loads(core.to_str())
    vocab = data["model"]["vocab"]
    for i in range(len(vocab), FIRST_SPECIAL_ID):  # never produced by a merge: ids only, like unused rows
        vocab[f"<|reserved_{i}|>"] = i
    core = Tokenizer.from_str(json.dumps(data))
    core.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                        clean_up_tokenization_spaces=False)
    tokenizer.chat_template = CHAT_TEMPLATE
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == IM_END_ID
    return tokenizer


# ---------------------------------------------------------------------------------------------- weights
def qwen3_config(shape: Qwen3Shape):
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=shape.vocab_size, hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers, num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads, head_dim=shape.head_dim,
        max_position_embeddings=shape.max_position_embeddings, rope_theta=shape.rope_theta, rms_norm_eps=1e-6,
        tie_word_embeddings=shape.tied, hidden_act="silu", attention_bias=False, initializer_range=0.02,
        bos_token_id=ENDOFTEXT_ID, eos_token_id=IM_END_ID, pad_token_id=None, dtype="float32")


def write_config(name: str, cache_dir: str | Path | None = None) -> Path:
    """A directory holding only config.json of shape `name` (a key of SHAPES): what `marlaas plan` and the GPU
    dry run read. Written once into the cache."""
    from marlaas_hpc.model.cache import default_cache_dir

    shape = SHAPES[name]
    out = Path(cache_dir or default_cache_dir()) / f"config-{name}-{fingerprint(shape, 0)}"
    if not (out / "config.json").is_file():
        staging = out.with_name(f"{out.name}.writing-{os.getpid()}")
        qwen3_config(shape).save_pretrained(str(staging))
        try:
            staging.rename(out)
        except OSError:  # another process wrote it first
            shutil.rmtree(staging, ignore_errors=True)
    return out


def build_random_qwen3(out_dir: str | Path, shape: Qwen3Shape, seed: int = 0) -> Path:
    """Writes config.json, model.safetensors (fp32, random), generation_config.json and the tokenizer."""
    import torch
    from transformers import GenerationConfig, Qwen3ForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(qwen3_config(shape)).float()
    # Qwen3's own generation_config.json: an eos list and sampling defaults a rollout engine must not apply
    model.generation_config = GenerationConfig(
        bos_token_id=ENDOFTEXT_ID, eos_token_id=[IM_END_ID, ENDOFTEXT_ID], pad_token_id=ENDOFTEXT_ID,
        do_sample=True, temperature=0.6, top_k=20, top_p=0.95)
    model.save_pretrained(str(out), safe_serialization=True)
    build_bpe_tokenizer().save_pretrained(str(out))
    return out


def fingerprint(shape: Qwen3Shape, seed: int) -> str:
    blob = json.dumps(asdict(shape), sort_keys=True).encode() + Path(__file__).read_bytes() + str(seed).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def ensure_random_qwen3(name: str, cache_dir: str | Path | None = None, seed: int = 0, log=print) -> Path:
    """Path of the cached random checkpoint `name` (a key of SHAPES), building it first if absent."""
    from marlaas_hpc.model.cache import default_cache_dir

    if name not in SHAPES:
        raise KeyError(f"unknown random checkpoint {name!r}; known: {sorted(SHAPES)}")
    shape = SHAPES[name]
    final = Path(cache_dir or default_cache_dir()) / f"random-{name}-{fingerprint(shape, seed)}"
    if (final / "config.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = final.with_name(f"{final.name}.building-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    log(f"[model] building random-weight checkpoint {name} into {final} (once)")
    build_random_qwen3(staging, shape, seed)
    try:
        staging.rename(final)
    except OSError:  # another process finished first: use theirs
        shutil.rmtree(staging, ignore_errors=True)
    return final
