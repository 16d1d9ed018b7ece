"""The reference a compact chat-mini model's pretraining loss is checked against: the same weights in transformers'
full model, whose logits span every row of the Qwen3 vocabulary (the rows chat-mini does not use stay zero)."""
from __future__ import annotations

import random

import torch

from marlaas_hpc.model.chat_mini import conversation, drill, live_ids
from marlaas_hpc.model.codec import TextCodec
from marlaas_hpc.model.vocabularies import QWEN3, build_tokenizer


def full_vocabulary_rows_and_loss(lm, full) -> tuple[list, float]:
    """Four training rows (three conversations and a drill, seeded) and their mean per-token cross-entropy under
    `full` (a transformers model of the Qwen3 vocabulary, in eval mode) after it takes `lm`'s weights: the compact
    embedding rows scattered to their token ids, the other rows zero, the output tied to the embedding."""
    codec, rng = TextCodec(build_tokenizer(QWEN3)), random.Random(1)
    rows = [conversation(codec, rng, 0.5) for _ in range(3)] + [drill(codec, rng, 0.5)]
    state = {k: v for k, v in lm.model.state_dict().items() if k != "lm_head.weight"}
    embed = torch.zeros(QWEN3.rows, state["model.embed_tokens.weight"].shape[1])
    embed[live_ids()] = state["model.embed_tokens.weight"]
    full.load_state_dict({**state, "model.embed_tokens.weight": embed}, strict=False)
    full.tie_weights()
    losses = []
    with torch.no_grad():
        for prompt, completion in rows:
            logits = full(input_ids=torch.tensor([prompt + completion])).logits[0, len(prompt) - 1:-1]
            losses.append(torch.nn.functional.cross_entropy(logits, torch.tensor(completion), reduction="sum"))
    return rows, float(sum(losses) / sum(len(c) for _, c in rows))
