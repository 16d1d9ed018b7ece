"""Character-level tokenizer in standard HF format (tokenizer.json), loadable by transformers and vLLM."""
from __future__ import annotations

import string
from pathlib import Path

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
VOCAB_SIZE = 128  # divisible by every TP size we run (1, 2, 4, 8): megatron shards the vocab evenly


def char_vocab() -> dict[str, int]:
    """Specials, then newline and printable ASCII, then unused fillers up to VOCAB_SIZE."""
    chars = ["\n"] + [c for c in string.printable if c not in "\t\n\r\x0b\x0c"]
    tokens = list(SPECIAL_TOKENS) + chars
    tokens += [f"<unused{i}>" for i in range(VOCAB_SIZE - len(tokens))]
    assert len(tokens) == VOCAB_SIZE
    return {tok: i for i, tok in enumerate(tokens)}


def build_char_tokenizer():
    """A PreTrainedTokenizerFast that maps every character to one token (no merges, no normalisation)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel(char_vocab(), unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<bos>", eos_token="<eos>",
                                   pad_token="<pad>", unk_token="<unk>", clean_up_tokenization_spaces=False)


def save_char_tokenizer(out_dir: str | Path) -> None:
    build_char_tokenizer().save_pretrained(str(out_dir))
