"""Base model: the project's tiny Qwen3-shaped model and its char tokenizer (real runs use a local HF path)."""
from marlaas_hpc.model.tiny import TinyModelConfig, build_tiny_model, ensure_tiny_model
from marlaas_hpc.model.tokenizer import TextCodec, build_char_tokenizer

__all__ = ["TextCodec", "TinyModelConfig", "build_char_tokenizer", "build_tiny_model", "ensure_tiny_model"]
