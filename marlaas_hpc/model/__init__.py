"""Base models: the project's tiny Qwen3-shaped model and its char tokenizer, random-weight checkpoints with real
Qwen3 traits (`random:<shape>`), checkpoint checks, and TextCodec (prompt text <-> token ids). Real runs point at a
local HF path.

The tiny model's builders import torch; they load on first use, so a rank that only encodes and decodes text
(scheduler, env) never imports it."""
from marlaas_hpc.model.codec import TextCodec

_TINY = {"TinyModelConfig", "build_tiny_model", "ensure_tiny_model"}

__all__ = ["TextCodec", "TinyModelConfig", "build_char_tokenizer", "build_tiny_model", "ensure_tiny_model"]


def __getattr__(name: str):
    if name in _TINY:
        from marlaas_hpc.model import tiny

        return getattr(tiny, name)
    if name == "build_char_tokenizer":
        from marlaas_hpc.model.tokenizer import build_char_tokenizer

        return build_char_tokenizer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
