"""Base models: the served families (Qwen3 dense, Qwen2 / Qwen2.5, Llama 3.x) and the checks a checkpoint must
pass, the char tokenizer of the project's tiny model (built by marlaas_hpc/tiny_model.py), the project's BPE in
each family's vocabulary and random-weight checkpoints with a family's real traits (`random:<shape>`), the local
cache, and TextCodec (prompt text <-> token ids). Real runs point at a local HF path.

The char tokenizer's builder imports transformers; it loads on first use, so a rank that only encodes and decodes
text (scheduler, env) never imports it."""
from marlaas_hpc.model.codec import TextCodec

__all__ = ["TextCodec", "build_char_tokenizer"]


def __getattr__(name: str):
    if name == "build_char_tokenizer":
        from marlaas_hpc.model.tokenizer import build_char_tokenizer

        return build_char_tokenizer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
