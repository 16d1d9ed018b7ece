"""Base models: the char tokenizer of the project's tiny model (built by marlaas_hpc/tiny_model.py), random-weight
checkpoints with real Qwen3 traits (`random:<shape>`), checkpoint checks, the local cache, and TextCodec (prompt
text <-> token ids). Real runs point at a local HF path.

The char tokenizer's builder imports transformers; it loads on first use, so a rank that only encodes and decodes
text (scheduler, env) never imports it."""
from marlaas_hpc.model.codec import TextCodec

__all__ = ["TextCodec", "build_char_tokenizer"]


def __getattr__(name: str):
    if name == "build_char_tokenizer":
        from marlaas_hpc.model.tokenizer import build_char_tokenizer

        return build_char_tokenizer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
