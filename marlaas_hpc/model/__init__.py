"""Base models: the project's tiny Qwen3-shaped model and its char tokenizer, random-weight checkpoints with real
Qwen3 traits (`random:<shape>`), checkpoint checks, and TextCodec (prompt text <-> token ids). Real runs point at a
local HF path."""
from marlaas_hpc.model.codec import TextCodec
from marlaas_hpc.model.tiny import TinyModelConfig, build_tiny_model, ensure_tiny_model
from marlaas_hpc.model.tokenizer import build_char_tokenizer

__all__ = ["TextCodec", "TinyModelConfig", "build_char_tokenizer", "build_tiny_model", "ensure_tiny_model"]
