"""TextCodec: the one place that turns a task's prompt text into token ids and sampled ids back into text.

Two prompt formats (TaskSpec.prompt, tasks/spec.py PromptSpec):
- raw: [bos] (if the tokenizer has one) + the text's tokens. Base models and the tiny char model.
- chat: the text is the user message (after an optional system message), rendered by the tokenizer's chat
  template with add_generation_prompt (and the task's template variables, e.g. enable_thinking=False). A prompt
  given as chat messages (a dataset's conversational column) is rendered as it is, after the task's system
  message unless it starts with its own.

A completion ends at the first stop id: the tokenizer's eos and every eos id of the checkpoint's
generation_config.json (a list for Qwen3: <|im_end|> and <|endoftext|>). The rollout engines stop at the same
ids (model/checkpoint.py `stop_token_ids`), and `decode_completion` cuts at the first of them.

Multi-turn (tool) episodes append tool output after a model turn that ended at its stop token: raw prompts
append the text's tokens; chat prompts append what the template puts between the end of an assistant turn and
the start of the next one, around the output as a 'tool' message (for ChatML: '\\n<|im_start|>user\\n
<tool_response>...</tool_response><|im_end|>\\n<|im_start|>assistant\\n').
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence


@dataclass(frozen=True)
class PromptFormat:
    """How prompts are rendered (the codec's view of tasks.spec.PromptSpec)."""

    format: str = "raw"
    system: str | None = None
    template_kwargs: tuple[tuple[str, Any], ...] = field(default=())

    @classmethod
    def of(cls, spec) -> "PromptFormat":
        """From a PromptSpec (or None: raw)."""
        if spec is None:
            return cls()
        return cls(spec.format, spec.system, tuple(sorted(spec.template_kwargs.items())))


class TextCodec:
    """Text <-> token ids for one tokenizer and one prompt format; `for_prompt` gives the codec of a task."""

    def __init__(self, tokenizer, stop_ids: list[int] | None = None, prompt: PromptFormat = PromptFormat()):
        self.tokenizer = tokenizer
        self.bos_id = tokenizer.bos_token_id
        self.eos_id = tokenizer.eos_token_id
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.stop_ids = list(dict.fromkeys(stop_ids if stop_ids is not None else [self.eos_id]))
        """Token ids that end a completion: the tokenizer's eos first, then generation_config.json's."""
        self.prompt = prompt
        self._observation_frame: tuple[str, str] | None = None
        self._variants: dict[PromptFormat, TextCodec] = {prompt: self}
        if prompt.format == "chat" and not getattr(tokenizer, "chat_template", None):
            raise ValueError("chat prompts need a chat template, and this tokenizer has none")

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "TextCodec":
        from marlaas_hpc.model.checkpoint import stop_token_ids
        from marlaas_hpc.model.tokenizer_file import load_tokenizer

        tokenizer = load_tokenizer(path)  # no transformers (nor torch) import where tokenizer.json suffices
        return cls(tokenizer, stop_token_ids(path, tokenizer))

    def for_prompt(self, spec) -> "TextCodec":
        """The codec of a task's prompt format (a PromptSpec or None); cached, shares the tokenizer."""
        fmt = PromptFormat.of(spec)
        if fmt not in self._variants:
            codec = TextCodec(self.tokenizer, self.stop_ids, fmt)
            codec._variants = self._variants
            self._variants[fmt] = codec
        return self._variants[fmt]

    # ---- prompts
    def encode_prompt(self, text: str) -> list[int]:
        if self.prompt.format == "chat":
            return self._encode_text(self._render(self._messages(text), add_generation_prompt=True))
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return ([self.bos_id] if self.bos_id is not None else []) + ids

    def _messages(self, prompt: str | Sequence[Mapping[str, str]]) -> list[dict[str, str]]:
        """The conversation of a chat prompt: the text as the user message, or the prompt's own messages (a
        dataset's conversational column; intake refuses those for raw prompts, tasks/gsm8k.py)."""
        if isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}]
        return self._conversation(prompt)

    def _conversation(self, messages: Sequence[Mapping[str, str]]) -> list[dict[str, str]]:
        """The messages after the task's system message, unless they bring their own."""
        messages = [dict(m) for m in messages]
        if self.prompt.system and not (messages and messages[0]["role"] == "system"):
            return [{"role": "system", "content": self.prompt.system}] + messages
        return messages

    def _render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                  **dict(self.prompt.template_kwargs))

    def _encode_text(self, text: str) -> list[int]:
        """Rendered template text -> ids; special-token strings in it become their ids."""
        return self.tokenizer.encode(text, add_special_tokens=False)

    # ---- multi-turn
    def encode_observation(self, text: str, turn_ids: list[int]) -> list[int]:
        """Tokens that follow a model turn `turn_ids` with tool output `text`. In chat form a turn cut off by
        its token cap is closed with the stop token first, as the template would have closed it."""
        if self.prompt.format != "chat":
            return self.tokenizer.encode(text, add_special_tokens=False)
        before, after = self._chat_observation_frame()
        closing = [] if turn_ids and turn_ids[-1] in self.stop_ids else [self.stop_ids[0]]
        return closing + self._encode_text(before + text + after)

    def _chat_observation_frame(self) -> tuple[str, str]:
        """(text between the assistant's stop token and the tool output, text after it up to the next
        assistant turn), read off the template by rendering a conversation that has a tool turn."""
        if self._observation_frame is None:
            marker, reply = "\x00TOOL\x00", "\x00REPLY\x00"
            history = self._messages("q") + [{"role": "assistant", "content": reply},
                                             {"role": "tool", "content": marker}]
            rendered = self._render(history, add_generation_prompt=True)
            stop_text = self.tokenizer.decode([self.stop_ids[0]], skip_special_tokens=False)
            end_of_turn = rendered.index(reply) + len(reply)
            if not rendered.startswith(stop_text, end_of_turn) or marker not in rendered:
                raise ValueError("the chat template does not end an assistant turn with the stop token "
                                 f"{stop_text!r} or drops tool messages; multi-turn chat episodes cannot be framed")
            before, _, after = rendered[end_of_turn + len(stop_text):].partition(marker)
            self._observation_frame = (before, after)
        return self._observation_frame

    # ---- completions
    def encode_completion(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False) + [self.eos_id]

    def decode_completion(self, token_ids: list[int]) -> str:
        """The text of a completion up to (not including) its first stop token."""
        cut = next((i for i, t in enumerate(token_ids) if t in self.stop_ids), len(token_ids))
        return self.tokenizer.decode(list(token_ids[:cut]), skip_special_tokens=True)
