"""An HF tokenizer dir read with the `tokenizers` library and jinja2, without importing transformers.

`from transformers import AutoTokenizer` imports torch: about 2.5 s of CPU in every rank, and the scheduler and
env ranks need nothing from torch, only text <-> ids. For a tokenizer that transformers itself loads straight
from tokenizer.json (tokenizer_class `TokenizersBackend` or `PreTrainedTokenizerFast`: the project's tiny and
random-weight checkpoints) `TokenizerFile` gives the same ids, text and chat renderings with neither import.
Other classes (e.g. a downloaded Qwen3's `Qwen2Tokenizer`, which transformers builds its own way) keep
AutoTokenizer: `load_tokenizer` decides.

The chat template renders as transformers renders it (utils/chat_template_utils.py): a sandboxed jinja
environment with trim_blocks, lstrip_blocks and loop controls, its `tojson` filter, `raise_exception` and
`strftime_now`, and the special tokens (bos_token, eos_token, ...) as template variables under the caller's.
The template comes from chat_template.jinja or tokenizer_config.json's `chat_template`.
"""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

FILE_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
"""tokenizer_class values that transformers loads from tokenizer.json as it is."""
SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def load_tokenizer(path: str | Path):
    """TokenizerFile when the dir's tokenizer is a plain tokenizer.json one, else transformers' AutoTokenizer."""
    path = Path(path)
    config = _read_json(path / "tokenizer_config.json")
    if (path / "tokenizer.json").is_file() and config.get("tokenizer_class") in FILE_CLASSES:
        return TokenizerFile(path, config)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


class TokenizerFile:
    """The part of an HF tokenizer that TextCodec uses: special-token ids, encode, decode, apply_chat_template."""

    def __init__(self, path: Path, config: dict[str, Any]):
        from tokenizers import Tokenizer

        self._tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        self.special_tokens_map = {name: _content(config[name]) for name in SPECIAL_NAMES
                                   if config.get(name) is not None}
        for name in SPECIAL_NAMES:  # bos_token / bos_token_id ..., as transformers' tokenizers name them
            token = self.special_tokens_map.get(name)
            setattr(self, name, token)
            setattr(self, f"{name}_id", None if token is None else self._tokenizer.token_to_id(token))
        self.clean_up_tokenization_spaces = bool(config.get("clean_up_tokenization_spaces", False))
        template = path / "chat_template.jinja"
        self.chat_template = template.read_text() if template.is_file() else config.get("chat_template")
        self._compiled = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        text = self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return _clean_up(text) if self.clean_up_tokenization_spaces else text

    def apply_chat_template(self, messages: list[dict], tokenize: bool = True, add_generation_prompt: bool = False,
                            **kwargs):
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        if self._compiled is None:
            self._compiled = _compile(self.chat_template)
        text = self._compiled.render(messages=messages, tools=None, documents=None,
                                     add_generation_prompt=add_generation_prompt,
                                     **{**self.special_tokens_map, **kwargs})
        return self.encode(text, add_special_tokens=False) if tokenize else text


def _compile(template: str):
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def _content(token) -> str:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken dict."""
    return token["content"] if isinstance(token, dict) else token


def _clean_up(text: str) -> str:
    """transformers' clean_up_tokenization: no space before punctuation and English contractions."""
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                          (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(before, after)
    return text


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}
