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


class TextCodec:
    """The one place that turns prompt text into token ids and sampled ids back into completion text.

    Works for the char tokenizer and for a real model's HF tokenizer: a prompt is [bos] (if the tokenizer
    has one) + the text's tokens; a completion ends at eos.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.bos_id = tokenizer.bos_token_id
        self.eos_id = tokenizer.eos_token_id
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "TextCodec":
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(str(path)))

    def encode_prompt(self, text: str) -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return ([self.bos_id] if self.bos_id is not None else []) + ids

    def encode_completion(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False) + [self.eos_id]

    def decode_completion(self, token_ids: list[int]) -> str:
        if self.eos_id in token_ids:
            token_ids = token_ids[: token_ids.index(self.eos_id)]
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)
