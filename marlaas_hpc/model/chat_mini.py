"""The project's small chat model: a Qwen3 checkpoint (tied embeddings, qk-norm, GQA, the 151,936-row vocabulary of
the project's BPE, model/vocabularies.py) pre-trained here on chat-format GSM8K-style problems, so that the
real-model path (chat prompts, an eos list, tied embeddings, a vocabulary megatron pads at TP=2, vLLM) can be
seen to learn (`model: chat-mini`; configs/qwen3-gsm8k-cpu.yaml).

Recipe (`ChatMiniConfig`, `pretrain`): one-step GSM8K-style problems (tasks/gsm8k.py `one_step_gsm8k`: 'Mia
has 7 apples and buys five more. How many ...?') asked through the chat template in the forms jobs use (with
or without a system message, `enable_thinking: false` or not, each answer format's instruction). The assistant
writes the sum out and then the answer: '7 + 5 = 12.\n#### 12' ending the turn with <|im_end|> when asked for
'####', '... The answer is \\boxed{12}.' ending it with <|endoftext|> when asked for a box, so the twin's two
tasks stop at different ids of the eos list. As with the tiny model, most answers make a systematic mistake
(the carry forgotten: '7 + 5 = 2') and the rest are right: the base model answers right where the two agree (a
third of the problems) and RL can teach the carry. Short arithmetic drills ('7 + 5 = 2.') beside the
conversations teach the sums faster than conversations alone.

Only the BPE's rows and the special tokens' rows of the embedding are trained; the other rows (the reserved
fillers and the rows past the tokenizer, 97% of the 151,936) stay zero, as unused rows of a real vocabulary
stay untrained. A zero row's logit is exactly 0 whatever the hidden state, so pre-training computes the full
151,936-way softmax from the live rows' logits and log(number of zero rows): exact, at 3% of the cost.

Shipping (as the tiny model): pre-training on another CPU's BLAS gives other weights, so the weights built on
the project's machine ship with the package (chat_mini_weights/: the live rows and the layers in bfloat16, the
tokenizer; ~3 MB) and any machine builds the full float32 checkpoint from them bit for bit (`ensure_chat_mini`);
pre-training runs only for another recipe (`python tools/build_chat_mini.py --ship` renews them).

chat-mini-moe (`model: chat-mini-moe`, `CHAT_MINI_MOE_CONFIG`) is the same recipe with `architecture: qwen3_moe`:
a Qwen3-MoE (8 experts top-2, renormalised, in every layer) in place of each dense MLP, pre-trained on the same
data with its routers trainable and a load-balancing term (the routers are frozen only in RL); its weights ship
in chat_mini_moe_weights/ (`--moe --ship`), its checkpoint holds the experts per expert as published Qwen3-MoE
checkpoints do. chat-mini's own pre-training code (`PRETRAINING`) stays as its shipped weights were made: the MoE
recipe adds code of its own (`MOE_PRETRAINING`) rather than editing it, and the dense fingerprint leaves the
architecture fields out.
"""
from __future__ import annotations

import hashlib
import inspect
import json
import math
import os
import random
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from marlaas_hpc.model.codec import TextCodec
from marlaas_hpc.model.vocabularies import (BPE_SIZE, ENDOFTEXT_ID, IM_END_ID, QWEN3, build_tokenizer,
                                            save_tokenizer)

CHAT_MINI = "chat-mini"
"""`JobConfig.model` naming this model."""
CHAT_MINI_MOE = "chat-mini-moe"
"""`JobConfig.model` naming its mixture-of-experts sibling (Qwen3-MoE)."""
SHIPPED_DIR = Path(__file__).with_name("chat_mini_weights")
SHIPPED_MOE_DIR = Path(__file__).with_name("chat_mini_moe_weights")
LIVE_WEIGHTS = "live_weights.safetensors"
META = "chat_mini.json"


@dataclass(kw_only=True, frozen=True)
class ChatMiniConfig:
    hidden_size: int = 128
    """Model width."""
    num_layers: int = 4
    """Decoder layers."""
    num_heads: int = 4
    """Query heads (head_dim 32: vLLM's CPU attention needs >= 32)."""
    num_kv_heads: int = 2
    """Key/value heads (GQA); TP=2 divides them."""
    intermediate_size: int = 384
    """SwiGLU hidden width."""
    seed: int = 1234
    """Initialisation and data seed."""
    pretrain_steps: int = 500
    """Optimizer steps of supervised pre-training (one-cycle lr)."""
    batch_size: int = 32
    """Conversations per step."""
    lr: float = 5e-3
    """Peak AdamW learning rate."""
    p_correct: float = 0.3
    """Probability that a pre-training answer is right; otherwise it is the carry-less mistake."""
    drills: int = 64
    """Arithmetic drills per step (`drill`), a loss term of their own beside the conversations'."""
    eval_size: int = 64
    """Eval problems per answer format for the progress lines and the shipped accuracy."""
    eval_every: int = 100
    """Steps between progress lines."""
    architecture: str = "qwen3"
    """'qwen3' (dense MLPs: chat-mini) or 'qwen3_moe' (a routed mixture of experts in every layer: chat-mini-moe)."""
    num_experts: int = 0
    """qwen3_moe: experts per layer (0 for qwen3)."""
    num_experts_per_tok: int = 0
    """qwen3_moe: experts each token is routed to (top-k)."""
    moe_intermediate_size: int = 0
    """qwen3_moe: each expert's SwiGLU hidden width (intermediate_size is then unused)."""
    router_aux_loss_coef: float = 0.0
    """qwen3_moe: weight of the routers' load-balancing loss (transformers' Switch-style one) in pre-training, where
    the routers train (RL freezes them); without it a few experts take every token."""

    def __post_init__(self):
        moe = (self.num_experts, self.num_experts_per_tok, self.moe_intermediate_size, self.router_aux_loss_coef)
        if self.architecture == "qwen3":
            if any(moe):
                raise ValueError(f"the MoE fields {MOE_FIELDS} are for architecture 'qwen3_moe', got {moe}")
        elif self.architecture == "qwen3_moe":
            if not (2 <= self.num_experts and 1 <= self.num_experts_per_tok <= self.num_experts
                    and self.moe_intermediate_size > 0 and self.router_aux_loss_coef >= 0):
                raise ValueError(f"qwen3_moe needs 2 <= num_experts, 1 <= num_experts_per_tok <= num_experts, "
                                 f"moe_intermediate_size > 0 and router_aux_loss_coef >= 0, got {moe}")
        else:
            raise ValueError(f"architecture must be 'qwen3' or 'qwen3_moe', got {self.architecture!r}")

    @property
    def name(self) -> str:
        """`JobConfig.model` naming this recipe's model."""
        return CHAT_MINI if self.architecture == "qwen3" else CHAT_MINI_MOE

    @property
    def shipped_dir(self) -> Path:
        """Where the package ships this architecture's weights."""
        return SHIPPED_DIR if self.architecture == "qwen3" else SHIPPED_MOE_DIR

    def fingerprint(self) -> str:
        """Identity of the recipe: this config and the source of what produces the weights (the pre-training
        functions, the problem generator, the vocabulary and its BPE, how prompts are encoded). The dense
        recipe's identity predates the architecture fields and leaves them out (its shipped weights stay
        valid); the MoE recipe's adds them and the MoE pre-training code."""
        from marlaas_hpc.model import vocabularies
        from marlaas_hpc.tasks import gsm8k

        fields, functions = asdict(self), PRETRAINING
        if self.architecture == "qwen3":
            fields = {k: v for k, v in fields.items() if k not in ("architecture", *MOE_FIELDS)}
        else:
            functions = PRETRAINING + MOE_PRETRAINING
        words = (gsm8k.INSTRUCTIONS, gsm8k._NAMES, gsm8k._ITEMS, gsm8k._NUMBER_WORDS)
        source = inspect.getsource(vocabularies).encode() + json.dumps(words).encode()
        for code in (*functions, gsm8k.one_step_gsm8k, gsm8k.gsm8k_prompt, gsm8k.synthetic_gsm8k, gsm8k._story,
                     TextCodec.encode_prompt, TextCodec._messages, TextCodec._conversation):
            source += inspect.getsource(code).encode()
        blob = json.dumps(fields, sort_keys=True).encode() + source
        return hashlib.sha256(blob).hexdigest()[:12]


MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "router_aux_loss_coef")
CHAT_MINI_MOE_CONFIG = ChatMiniConfig(architecture="qwen3_moe", num_experts=8, num_experts_per_tok=2,
                                      moe_intermediate_size=96, router_aux_loss_coef=0.01, pretrain_steps=900)
"""chat-mini-moe's recipe: chat-mini's widths, data and schedule with 8 experts top-2 (renormalised) in place of
each dense MLP; experts of 96 (the active MLP width per token, 192, half chat-mini's 384; 768 in all). 900 steps,
not 500: after chat-mini's 500 it put 29% of its probability on the worked answers of carry problems (right or
with the carry forgotten; chat-mini 88%) and 8% on the right one (chat-mini 30%), too rare for RL's groups of 8."""
RECIPES = {CHAT_MINI: ChatMiniConfig(), CHAT_MINI_MOE: CHAT_MINI_MOE_CONFIG}
"""`JobConfig.model` names of the project's small chat models -> their recipes."""


# ---------------------------------------------------------------------------------------------- the model
def live_ids() -> list[int]:
    """Rows of the embedding that are trained: the BPE's tokens and the special tokens."""
    first = QWEN3.first_special_id
    return list(range(BPE_SIZE)) + list(range(first, first + len(QWEN3.special_tokens)))


def qwen3_config(cfg: ChatMiniConfig, vocab_size: int):
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.hidden_size // cfg.num_heads, max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}, rms_norm_eps=1e-6,
        tie_word_embeddings=True, hidden_act="silu", attention_bias=False, initializer_range=0.02,
        bos_token_id=ENDOFTEXT_ID, eos_token_id=IM_END_ID, pad_token_id=None, use_sliding_window=False,
        dtype="float32")


PROMPT_FORMS = (
    {"system": "You are a careful math tutor.", "template_kwargs": {"enable_thinking": False}},
    {"template_kwargs": {"enable_thinking": False}},
    {"system": "You are a helpful assistant."},
    {},
)
"""Chat prompt forms of pre-training (PromptSpec fields): with or without a system message and a pre-filled
empty think block."""
ANSWER_FORMATS = ("hash", "boxed", None)


def completion_text(terms: list[int], answer: str, answer_format: str | None) -> tuple[str, int]:
    """(text, stop id) of a worked answer in the asked form: the sum written out, then '#### N' ending the turn
    with <|im_end|>, or '\\boxed{N}' ending it with <|endoftext|> (the eos list's second id)."""
    work = f"{terms[0]} + {terms[1]} = {answer}.\n"
    if answer_format == "boxed":
        return work + "The answer is \\boxed{" + answer + "}.", ENDOFTEXT_ID
    return work + f"#### {answer}", IM_END_ID


Row = tuple[list[int], list[int]]
"""(prompt ids, completion ids) of one conversation."""


def conversation(codec: TextCodec, rng: random.Random, p_correct: float) -> Row:
    """One pre-training conversation: a problem in a random prompt form and answer format, answered right with
    probability p_correct, else with the carry forgotten."""
    from marlaas_hpc.tasks.gsm8k import gsm8k_prompt, one_step_gsm8k
    from marlaas_hpc.tasks.spec import PromptSpec

    question, answer, meta = one_step_gsm8k(rng)
    answer_format = rng.choice(ANSWER_FORMATS)
    chat = codec.for_prompt(PromptSpec(format="chat", **rng.choice(PROMPT_FORMS)))
    prompt = chat.encode_prompt(gsm8k_prompt(question, "chat", answer_format))
    text, stop = completion_text(meta["terms"], answer if rng.random() < p_correct else meta["mistake"],
                                 answer_format)
    return prompt, codec.tokenizer.encode(text, add_special_tokens=False) + [stop]


def drill(codec: TextCodec, rng: random.Random, p_correct: float) -> Row:
    """One arithmetic drill: the worked line of a conversation ('48 + 7 = 55.') alone, right with probability
    p_correct: short rows that teach the sum (or its mistake) faster than whole conversations."""
    from marlaas_hpc.tasks.gsm8k import one_step_gsm8k

    _, answer, meta = one_step_gsm8k(rng)
    a, b = meta["terms"]
    result = answer if rng.random() < p_correct else meta["mistake"]
    encode = codec.tokenizer.encode
    return encode(f"{a} + {b} =", add_special_tokens=False), encode(f" {result}.\n", add_special_tokens=False)


class CompactLM:
    """The checkpoint's Qwen3 over the live rows only: ids are renumbered into the live rows, and the softmax
    adds the zero rows' exact share (each contributes exp(0) = 1 to the normaliser)."""

    def __init__(self, cfg: ChatMiniConfig, rows: int):
        import torch
        from transformers import Qwen3ForCausalLM

        live = live_ids()
        self.index = torch.full((QWEN3.rows,), -1, dtype=torch.long)
        self.index[live] = torch.arange(len(live))
        self.log_zero_rows = math.log(rows - len(live))
        self.model = Qwen3ForCausalLM(qwen3_config(cfg, len(live))).float()

    def loss(self, rows: list[Row]):
        """Mean negative log-likelihood of the completions' tokens under the full-vocabulary softmax."""
        import torch

        ids, targets, mask = self._batch(rows)
        hidden = self.model.model(input_ids=ids, attention_mask=mask).last_hidden_state
        chosen = targets >= 0
        logits = hidden[chosen] @ self.model.model.embed_tokens.weight.t()
        zero_rows = torch.full((logits.shape[0], 1), self.log_zero_rows)
        log_z = torch.logsumexp(torch.cat([logits, zero_rows], dim=1), dim=1)
        return (log_z - logits.gather(1, targets[chosen].unsqueeze(1)).squeeze(1)).mean()

    def _batch(self, rows: list[Row]):
        """Right-padded compact ids, targets (-1 except where a completion token is predicted) and the mask."""
        import torch

        width = max(len(p) + len(c) for p, c in rows)
        ids = torch.zeros((len(rows), width), dtype=torch.long)
        targets = torch.full((len(rows), width), -1, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, (prompt, completion) in enumerate(rows):
            seq = self.index[torch.tensor(prompt + completion)]
            ids[i, :len(seq)], mask[i, :len(seq)] = seq, 1
            targets[i, len(prompt) - 1:len(seq) - 1] = seq[len(prompt):]
        return ids, targets, mask


def pretrain(cfg: ChatMiniConfig, log=print):
    """The pre-trained CompactLM (deterministic for a config on one machine)."""
    import torch

    torch.manual_seed(cfg.seed)
    codec = TextCodec(build_tokenizer(QWEN3))
    lm = CompactLM(cfg, QWEN3.rows)
    opt = torch.optim.AdamW(lm.model.parameters(), lr=cfg.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, cfg.lr, total_steps=cfg.pretrain_steps, pct_start=0.05)
    rng, start = random.Random(cfg.seed), time.time()
    lm.model.train()
    for step in range(1, cfg.pretrain_steps + 1):
        loss = lm.loss([conversation(codec, rng, cfg.p_correct) for _ in range(cfg.batch_size)])
        if cfg.drills:
            loss = loss + lm.loss([drill(codec, rng, cfg.p_correct) for _ in range(cfg.drills)])
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(lm.model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % cfg.eval_every == 0 or step == cfg.pretrain_steps:
            log(f"[chat-mini] step {step}/{cfg.pretrain_steps}: loss {loss.item():.3f} ({time.time() - start:.0f}s)")
    lm.model.eval()
    return lm


PRETRAINING = (qwen3_config, completion_text, conversation, drill, CompactLM, pretrain)
"""The code whose source is part of the recipe's fingerprint."""


# ---------------------------------------------------------------------------------------------- the MoE sibling
def qwen3_moe_config(cfg: ChatMiniConfig, vocab_size: int):
    """chat-mini's Qwen3 config with a routed MoE block in every layer (Qwen3-30B-A3B's form: no dense layers,
    top-k weights renormalised); tied embeddings as chat-mini (the compact softmax reads the embedding)."""
    from transformers import Qwen3MoeConfig

    dense = qwen3_config(cfg, vocab_size).to_dict()
    keep = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "max_position_embeddings", "rope_parameters", "rms_norm_eps", "tie_word_embeddings",
            "hidden_act", "attention_bias", "initializer_range", "bos_token_id", "eos_token_id", "pad_token_id",
            "use_sliding_window", "dtype")
    return Qwen3MoeConfig(**{k: dense[k] for k in keep}, intermediate_size=cfg.intermediate_size,
                          num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                          moe_intermediate_size=cfg.moe_intermediate_size, norm_topk_prob=True,
                          decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=cfg.router_aux_loss_coef)


class CompactMoeLM(CompactLM):
    """CompactLM over the Qwen3-MoE: the same compact softmax, plus the routers' load-balancing loss (pre-training
    trains the routers; without the balance term a few experts would take every token)."""

    def __init__(self, cfg: ChatMiniConfig, rows: int):
        import torch
        from transformers import Qwen3MoeForCausalLM

        live = live_ids()
        self.index = torch.full((QWEN3.rows,), -1, dtype=torch.long)
        self.index[live] = torch.arange(len(live))
        self.log_zero_rows = math.log(rows - len(live))
        self.model = Qwen3MoeForCausalLM(qwen3_moe_config(cfg, len(live))).float()
        self.coef, self.router_logits = cfg.router_aux_loss_coef, []
        for layer in self.model.model.layers:  # each router's logits of the forward pass, for the balance term
            layer.mlp.gate.register_forward_hook(lambda _m, _i, out: self.router_logits.append(out[0]))

    def loss(self, rows: list[Row]):
        """The completions' mean NLL (CompactLM.loss) + coef x the load-balancing loss over the real tokens."""
        from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

        self.router_logits.clear()
        nll = CompactLM.loss(self, rows)
        if not self.coef or not self.model.training:
            return nll
        config = self.model.config
        mask = self._batch(rows)[2]
        balance = load_balancing_loss_func(tuple(self.router_logits), config.num_experts,
                                           config.num_experts_per_tok, mask)
        return nll + self.coef * balance


def pretrain_moe(cfg: ChatMiniConfig, log=print):
    """`pretrain` for the MoE recipe: its loop on a CompactMoeLM (`pretrain` itself, whose source is chat-mini's
    recipe identity, stays as chat-mini's shipped weights were made)."""
    import torch

    torch.manual_seed(cfg.seed)
    codec = TextCodec(build_tokenizer(QWEN3))
    lm = CompactMoeLM(cfg, QWEN3.rows)
    opt = torch.optim.AdamW(lm.model.parameters(), lr=cfg.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, cfg.lr, total_steps=cfg.pretrain_steps, pct_start=0.05)
    rng, start = random.Random(cfg.seed), time.time()
    lm.model.train()
    for step in range(1, cfg.pretrain_steps + 1):
        loss = lm.loss([conversation(codec, rng, cfg.p_correct) for _ in range(cfg.batch_size)])
        if cfg.drills:
            loss = loss + lm.loss([drill(codec, rng, cfg.p_correct) for _ in range(cfg.drills)])
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(lm.model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % cfg.eval_every == 0 or step == cfg.pretrain_steps:
            log(f"[{cfg.name}] step {step}/{cfg.pretrain_steps}: loss {loss.item():.3f} ({time.time() - start:.0f}s)")
    lm.model.eval()
    return lm


MOE_PRETRAINING = (qwen3_moe_config, CompactMoeLM, pretrain_moe)
"""The MoE recipe's own code, part of its fingerprint beside PRETRAINING."""


def model_config(cfg: ChatMiniConfig, vocab_size: int):
    """The transformers config of the recipe's architecture."""
    return qwen3_config(cfg, vocab_size) if cfg.architecture == "qwen3" else qwen3_moe_config(cfg, vocab_size)


def published_tensors(tensors: dict, cfg: ChatMiniConfig) -> dict:
    """The state dict under the published checkpoints' key names: transformers keeps each layer's experts fused
    (experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I]); Qwen3-MoE checkpoints hold them per expert
    (experts.{e}.gate_proj / up_proj / down_proj.weight), the form every reader of the checkpoint expects."""
    if cfg.architecture == "qwen3":
        return tensors
    out = {}
    for key, value in tensors.items():
        if key.endswith(".mlp.experts.gate_up_proj"):
            prefix = key[:-len("gate_up_proj")]
            for e in range(value.shape[0]):
                gate, up = value[e].chunk(2, dim=0)
                out[f"{prefix}{e}.gate_proj.weight"], out[f"{prefix}{e}.up_proj.weight"] = gate.clone(), up.clone()
        elif key.endswith(".mlp.experts.down_proj"):
            prefix = key[:-len("down_proj")]
            for e in range(value.shape[0]):
                out[f"{prefix}{e}.down_proj.weight"] = value[e].clone()
        else:
            out[key] = value
    return out


# ---------------------------------------------------------------------------------------------- evaluation
EVAL_TASKS = {
    "hash": ({"system": "You are a careful math tutor.", "template_kwargs": {"enable_thinking": False}}, 0),
    "boxed": ({"template_kwargs": {"enable_thinking": False}}, 1),
}
"""Answer format -> (prompt form, data seed) of the twin's tasks (configs/qwen3-gsm8k-cpu.yaml)."""


def greedy_accuracy(logits_of, codec: TextCodec, eval_size: int, max_new_tokens: int = 24) -> dict[str, float]:
    """Greedy accuracy of `logits_of(ids [b, s]) -> next-token logits [b, V]` on the twin's eval splits (full
    recompute per token, prompts batched by length: no padding); a completion ends at the first id of the eos
    list, as in the rollout engines."""
    import torch

    from marlaas_hpc.tasks import DatasetSpec
    from marlaas_hpc.tasks.spec import PromptSpec
    from marlaas_hpc.tasks.synthetic import Gsm8kSyntheticTask

    out = {}
    for answer_format, (form, seed) in EVAL_TASKS.items():
        task = Gsm8kSyntheticTask(DatasetSpec(kind="gsm8k_easy", seed=seed, eval_size=eval_size,
                                              answer_format=answer_format), "chat")
        chat = codec.for_prompt(PromptSpec(format="chat", **form))
        by_length: dict[int, list] = {}
        for sample in task.eval_samples():
            prompt = chat.encode_prompt(sample.prompt)
            by_length.setdefault(len(prompt), []).append((sample, prompt))
        correct = 0
        for group in by_length.values():
            ids = torch.tensor([prompt for _, prompt in group])
            for _ in range(max_new_tokens):
                ids = torch.cat([ids, logits_of(ids).argmax(-1, keepdim=True)], dim=1)
            for (sample, prompt), row in zip(group, ids[:, len(prompt):].tolist()):
                correct += task.reward(sample, chat.decode_completion(row)) == 1.0
        out[answer_format] = correct / eval_size
    return out


# ---------------------------------------------------------------------------------------------- checkpoint
TOKENIZER_FILES = ("tokenizer_config.json", "chat_template.jinja")
"""Tokenizer files shipped as they are; tokenizer.json (5 MB of mostly filler entries) ships xz-compressed."""


def save_shipped(lm: CompactLM, out_dir: Path) -> None:
    """The shipped form: the compact model's tensors in bfloat16 (the embedding's live rows and every layer;
    the tied head dropped) and the tokenizer files."""
    import lzma

    import torch
    from safetensors.torch import save_file

    tensors = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in lm.model.state_dict().items()
               if k != "lm_head.weight"}
    save_file(tensors, str(out_dir / LIVE_WEIGHTS), metadata={"format": "pt"})
    save_tokenizer(QWEN3, out_dir)
    tokenizer = out_dir / "tokenizer.json"
    (out_dir / "tokenizer.json.xz").write_bytes(lzma.compress(tokenizer.read_bytes()))
    tokenizer.unlink()


def write_checkpoint(out_dir: str | Path, cfg: ChatMiniConfig, shipped: Path) -> Path:
    """The full HF checkpoint from the shipped form: float32 weights with the embedding's live rows put back at
    their ids among zero rows (copies and exact conversions: the same bytes on any machine), config, generation
    config (Qwen3's eos list and sampling defaults, which the rollout engines ignore) and tokenizer."""
    import lzma

    import torch
    from safetensors.torch import load_file, save_file
    from transformers import GenerationConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.float() for k, v in load_file(str(shipped / LIVE_WEIGHTS)).items()}
    compact = tensors["model.embed_tokens.weight"]
    embed = torch.zeros((QWEN3.rows, compact.shape[1]), dtype=torch.float32)
    embed[torch.tensor(live_ids())] = compact
    save_file(published_tensors({**tensors, "model.embed_tokens.weight": embed}, cfg),
              str(out / "model.safetensors"), metadata={"format": "pt"})
    config = model_config(cfg, QWEN3.rows)
    config.architectures = ["Qwen3ForCausalLM" if cfg.architecture == "qwen3" else "Qwen3MoeForCausalLM"]
    config.save_pretrained(str(out))
    GenerationConfig(bos_token_id=ENDOFTEXT_ID, eos_token_id=[IM_END_ID, ENDOFTEXT_ID], pad_token_id=ENDOFTEXT_ID,
                     do_sample=True, temperature=0.6, top_k=20, top_p=0.95).save_pretrained(str(out))
    for name in TOKENIZER_FILES:
        shutil.copy(shipped / name, out / name)
    (out / "tokenizer.json").write_bytes(lzma.decompress((shipped / "tokenizer.json.xz").read_bytes()))
    return out


def checkpoint_accuracy(path: Path, eval_size: int) -> dict[str, float]:
    """Greedy accuracy of the full checkpoint, loaded by transformers (151,936-way logits)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()

    def logits_of(ids):
        with torch.no_grad():
            return model(input_ids=ids, logits_to_keep=1).logits[:, -1]

    return greedy_accuracy(logits_of, TextCodec.from_pretrained(path), eval_size)


def build_chat_mini(out_dir: str | Path, cfg: ChatMiniConfig = ChatMiniConfig(), log=print) -> dict:
    """Pre-trains and writes the shipped form into out_dir; returns its meta (with the greedy eval accuracy of
    the full checkpoint built from it)."""
    import tempfile

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    start = time.time()
    save_shipped((pretrain if cfg.architecture == "qwen3" else pretrain_moe)(cfg, log), out)
    seconds = time.time() - start
    with tempfile.TemporaryDirectory() as full:
        accuracy = checkpoint_accuracy(write_checkpoint(full, cfg, out), cfg.eval_size)
    log(f"[{cfg.name}] greedy eval accuracy " + " ".join(f"{k}={v:.2f}" for k, v in accuracy.items()))
    meta = {"config": asdict(cfg), "eval_accuracy": accuracy, "pretrain_seconds": round(seconds, 1),
            "fingerprint": cfg.fingerprint()}
    (out / META).write_text(json.dumps(meta, indent=2))
    return meta


def shipped_fingerprint(cfg: ChatMiniConfig = ChatMiniConfig()) -> str | None:
    """The recipe fingerprint of the weights shipped for cfg's architecture (None: none shipped)."""
    meta = cfg.shipped_dir / META
    return json.loads(meta.read_text())["fingerprint"] if meta.is_file() else None


def ensure_chat_mini(cfg: ChatMiniConfig = ChatMiniConfig(), cache_dir: str | Path | None = None,
                     log=print) -> Path:
    """Path of the cached full checkpoint: built from the shipped weights when they are this recipe's, else
    pre-trained first (atomic: made aside, then renamed)."""
    from marlaas_hpc.model.cache import default_cache_dir

    final = Path(cache_dir or default_cache_dir()) / f"{cfg.name}-{cfg.fingerprint()}"
    if (final / META).is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = final.with_name(f"{final.name}.building-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    shipped = cfg.shipped_dir
    if shipped_fingerprint(cfg) != cfg.fingerprint():
        log(f"[{cfg.name}] pre-training {final} (once; a few minutes on 2 cores)")
        shipped = staging.with_name(staging.name + ".shipped")
        build_chat_mini(shipped, cfg, log)
    else:
        log(f"[{cfg.name}] {final}: from the weights shipped with the package")
    write_checkpoint(staging, cfg, shipped)
    shutil.copy(shipped / META, staging / META)
    if shipped != cfg.shipped_dir:
        shutil.rmtree(shipped, ignore_errors=True)
    try:
        staging.rename(final)
    except OSError:  # another process finished first: use theirs
        shutil.rmtree(staging, ignore_errors=True)
    return final
