"""The project's own tiny Qwen3-shaped base model: built, briefly pre-trained and cached locally.

Nothing is downloaded: the builder makes a char tokenizer, a Qwen3 config with head_dim 32 (vLLM's CPU
attention needs >= 32), pre-trains on the synthetic tasks with answers that are mostly a systematic
mistake (see tasks/synthetic.py), so each task starts at 5-50% greedy accuracy with room for RL, and saves
standard HF files (config.json, model.safetensors, tokenizer files) that transformers, vLLM and mbridge all load.

The mix also holds the tool-requiring `lookup` workload (marlaas_hpc.env): a minority of its sequences
demonstrate the tool call and the use of its result ('c4+7=' -> '?', observation '23+7=', '30'), the rest
make the realistic mistake of answering blind (the addend), and some tool transcripts train only the answer
after the observation. So the base policy samples the tool call now and then but greedily answers blind:
RL can raise the tool-call rate and, with it, the accuracy.

The recipe needs the tasks and the env's workloads, so it lives above both (the model package below them holds
the codec and tokenizers they use); the built weights ship in tiny_weights/ beside this module.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from marlaas_hpc.env.kinds import build_task_data
from marlaas_hpc.model.cache import default_cache_dir
from marlaas_hpc.model.codec import TextCodec
from marlaas_hpc.model.tokenizer import VOCAB_SIZE, build_char_tokenizer
from marlaas_hpc.tasks import SYNTHETIC_KINDS, DatasetSpec, Sample


@dataclass(kw_only=True, frozen=True)
class TinyModelConfig:
    hidden_size: int = 128
    """Model width."""
    num_layers: int = 4
    """Decoder layers."""
    num_heads: int = 4
    """Query heads (head_dim fixed at 32)."""
    num_kv_heads: int = 2
    """Key/value heads (GQA); TP size must divide it."""
    intermediate_size: int = 384
    """SwiGLU hidden width."""
    seed: int = 1234
    """Initialisation and data seed."""
    pretrain_steps: int = 900
    """Optimizer steps of supervised pre-training (cosine-decayed lr)."""
    eval_every: int = 150
    """Steps between progress lines (greedy eval accuracy per task)."""
    batch_size: int = 64
    """Sequences per pre-training step (tasks interleaved)."""
    lr: float = 2e-3
    """Peak AdamW learning rate of pre-training."""
    p_correct: float = 0.3
    """Probability that a pre-training answer is right; otherwise it is the task's systematic mistake.
    The base model then prefers the mistake, and is right where the two agree (28-47% of inputs)."""
    lookup_examples: int = 8
    """Lookup-workload episodes per pre-training step (on top of batch_size, in a loss term of their own)."""
    lookup_loss_weight: float = 0.25
    """Weight of the lookup sequences' mean token loss next to the synthetic tasks' (which keep weight 1, so
    their pre-training, and with it how well RL can still move them, stays close to a model without lookup)."""
    lookup_p_tool: float = 0.3
    """Fraction of those that call the tool and answer from its result; the others answer blind (mistake)."""
    lookup_drills: int = 4
    """Lookup tool transcripts per step in which only the answer after the observation is trained (the call
    is context, not trained): teaches using a tool result without teaching to call the tool."""

    def fingerprint(self) -> str:
        """Identity of the recipe: this config and the source of the code that produces the weights (the
        pre-training functions below, the tokenizer, how prompts are encoded, the lookup workload in the mix).
        Not the rest of this module: an edit to its imports or docs must not orphan the shipped weights."""
        import inspect

        from marlaas_hpc.env.workloads import LookupTask

        source = (Path(__file__).parent / "model" / "tokenizer.py").read_bytes()
        for code in (*PRETRAINING, TextCodec.encode_prompt, LookupTask):
            source += inspect.getsource(code).encode()
        blob = json.dumps(asdict(self), sort_keys=True).encode() + source
        return hashlib.sha256(blob).hexdigest()[:12]


def qwen3_config(cfg: TinyModelConfig):
    from transformers import Qwen3Config

    tok = build_char_tokenizer()
    return Qwen3Config(
        vocab_size=VOCAB_SIZE, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads, head_dim=32, max_position_embeddings=256,
        rms_norm_eps=1e-6, tie_word_embeddings=False, hidden_act="silu", attention_bias=False,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        dtype="float32")


Row = tuple[list[int], list[int], list[int]]
"""(prompt_ids, completion_ids, loss_mask) of one pre-training sequence."""


def answer_row(codec: TextCodec, prompt: str, answer: str) -> Row:
    completion = codec.encode_completion(answer)
    return codec.encode_prompt(prompt), completion, [1] * len(completion)


def lookup_rows(codec: TextCodec, task, cursor: int, cfg: "TinyModelConfig", coin) -> list[Row]:
    """One step's lookup sequences: tool demonstrations, blind answers, and answer drills (call masked)."""
    rows = []
    for i in range(cfg.lookup_examples + cfg.lookup_drills):
        sample = task.train_sample(cursor + i)
        if i >= cfg.lookup_examples:
            prompt, completion, mask = task.demonstration_ids(codec, sample, use_tool=True)
            call_len = mask.index(0)  # the call turn: context here, not trained
            rows.append((prompt, completion, [0] * call_len + mask[call_len:]))
        else:
            rows.append(task.demonstration_ids(codec, sample, use_tool=coin.random() < cfg.lookup_p_tool))
    return rows


def _batch(codec: TextCodec, rows: list[Row]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded input ids and labels (-100 outside the trained completion tokens)."""
    import torch

    seqs, labels = [], []
    for prompt, completion, mask in rows:
        seqs.append(prompt + completion)
        labels.append([-100] * len(prompt) + [t if m else -100 for t, m in zip(completion, mask)])
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), codec.pad_id)
    lab = torch.full((len(seqs), width), -100)
    for i, (s, l) in enumerate(zip(seqs, labels)):
        ids[i, : len(s)] = torch.tensor(s)
        lab[i, : len(l)] = torch.tensor(l)
    return ids, lab


def _loss(model, codec: TextCodec, rows: list[Row]) -> torch.Tensor:
    ids, labels = _batch(codec, rows)
    return model(input_ids=ids, attention_mask=(ids != codec.pad_id).long(), labels=labels).loss


def greedy_accuracy(model, codec: TextCodec, task, samples: list[Sample], max_new_tokens: int = 8) -> float:
    """Greedy decoding by full recompute, batched by prompt length (no padding, so it is exact). No grad: the
    caller's (pre-training evals run under torch.no_grad)."""
    import torch

    by_len: dict[int, list[Sample]] = {}
    for s in samples:
        by_len.setdefault(len(codec.encode_prompt(s.prompt)), []).append(s)
    correct = 0
    for group in by_len.values():
        ids = torch.tensor([codec.encode_prompt(s.prompt) for s in group])
        prompt_len = ids.shape[1]
        for _ in range(max_new_tokens):
            next_ids = model(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, next_ids], dim=1)
        for s, row in zip(group, ids[:, prompt_len:].tolist()):
            correct += task.reward(s, codec.decode_completion(row)) == 1.0
    return correct / len(samples)


def greedy_episodes(model, codec: TextCodec, task, samples: list[Sample], max_new_tokens: int = 8,
                    max_turns: int = 3) -> dict[str, float]:
    """Greedy multi-turn episodes of a tool task, one sample at a time: accuracy and tool-call rate (no grad: the
    caller's)."""
    from marlaas_hpc.env.protocol import Final, environment_for

    correct = called = 0
    for sample in samples:
        env = environment_for(task)
        ids = codec.encode_prompt(env.reset(sample))
        for _ in range(max_turns):
            turn = _greedy_turn(model, codec, ids, max_new_tokens)
            ids += turn
            result = env.step(codec.decode_completion(turn))
            if isinstance(result, Final):
                correct += result.reward == 1.0
                break
            called += 1 if result.tool_calls else 0
            ids += codec.tokenizer.encode(result.text, add_special_tokens=False)
    return {"accuracy": correct / len(samples), "tool_call_rate": called / len(samples)}


def _greedy_turn(model, codec: TextCodec, ids: list[int], max_new_tokens: int) -> list[int]:
    import torch

    turn: list[int] = []
    for _ in range(max_new_tokens):
        token = int(model(input_ids=torch.tensor([ids + turn])).logits[0, -1].argmax())
        turn.append(token)
        if token == codec.eos_id:
            break
    return turn


def base_accuracies(model, codec: TextCodec, tasks: list, lookup) -> dict[str, float]:
    import torch

    with torch.no_grad():
        accuracy = {t.kind: greedy_accuracy(model, codec, t, t.eval_samples()) for t in tasks}
        episodes = greedy_episodes(model, codec, lookup, lookup.eval_samples())
    accuracy.update(lookup=episodes["accuracy"], lookup_tool_call_rate=episodes["tool_call_rate"])
    return accuracy


def build_tiny_model(out_dir: str | Path, cfg: TinyModelConfig = TinyModelConfig(), log=print) -> dict:
    """Builds and pre-trains the tiny model into out_dir; returns per-task greedy eval accuracies."""
    import random

    import torch
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(cfg.seed)
    coin = random.Random(cfg.seed)
    tokenizer = build_char_tokenizer()
    codec = TextCodec(tokenizer)
    model = Qwen3ForCausalLM(qwen3_config(cfg)).float()
    tasks = [build_task_data(DatasetSpec(kind=k, seed=cfg.seed, eval_size=96)) for k in SYNTHETIC_KINDS]
    lookup = build_task_data(DatasetSpec(kind="lookup", seed=cfg.seed, eval_size=96))
    lookup_coin = random.Random(f"lookup-{cfg.seed}")  # its own stream: the other tasks' mix is unchanged
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, cfg.pretrain_steps, eta_min=cfg.lr * 0.05)
    start, accuracy = time.time(), {}
    for step in range(1, cfg.pretrain_steps + 1):
        model.train()
        rows = []
        for i in range(cfg.batch_size):
            cursor = step * cfg.batch_size + i
            sample = tasks[cursor % len(tasks)].train_sample(cursor)
            right = coin.random() < cfg.p_correct
            rows.append(answer_row(codec, sample.prompt, sample.answer if right else sample.meta["mistake"]))
        extra = lookup_rows(codec, lookup, step * (cfg.lookup_examples + cfg.lookup_drills), cfg, lookup_coin)
        loss = _loss(model, codec, rows) + cfg.lookup_loss_weight * _loss(model, codec, extra)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if step % cfg.eval_every == 0 or step == cfg.pretrain_steps:
            model.eval()
            accuracy = base_accuracies(model, codec, tasks, lookup)
            log(f"[tiny-model] step {step}/{cfg.pretrain_steps}: loss {loss.item():.3f} greedy accuracy "
                + " ".join(f"{k}={v:.2f}" for k, v in accuracy.items()) + f" ({time.time() - start:.0f}s)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.generation_config.do_sample = False
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    (out / "marlaas_tiny.json").write_text(json.dumps({"config": asdict(cfg), "eval_accuracy": accuracy,
                                                        "fingerprint": cfg.fingerprint()}, indent=2))
    return accuracy


PRETRAINING = (qwen3_config, answer_row, lookup_rows, _batch, _loss, build_tiny_model)
"""The functions whose source is part of the recipe's fingerprint (the evals that pre-training logs are not)."""

SHIPPED_DIR = Path(__file__).with_name("tiny_weights")
"""The default config's model as built on the project's machine (3.3 MB), shipped with the package: every host
starts from the same weights (pre-training on another CPU's BLAS gave other weights, and a task that learned on
one host stalled on another) and nobody waits for the build. `python tools/build_tiny_model.py --ship` renews it
after a change to the recipe (tests/test_tiny_model.py fails until then)."""


def shipped_fingerprint() -> str | None:
    """The recipe fingerprint of the shipped weights (None: none shipped)."""
    meta = SHIPPED_DIR / "marlaas_tiny.json"
    return json.loads(meta.read_text())["fingerprint"] if meta.is_file() else None


def ensure_tiny_model(cfg: TinyModelConfig = TinyModelConfig(), cache_dir: str | Path | None = None,
                      log=print) -> Path:
    """Path of the cached tiny model; if absent, the shipped weights when they are this recipe's, else built
    (atomic: made aside, then renamed)."""
    final = Path(cache_dir or default_cache_dir()) / f"tiny-qwen3-{cfg.fingerprint()}"
    if (final / "marlaas_tiny.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = final.with_name(f"{final.name}.building-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    if shipped_fingerprint() == cfg.fingerprint():
        shutil.copytree(SHIPPED_DIR, staging)
        log(f"[tiny-model] {final}: the weights shipped with the package")
    else:
        log(f"[tiny-model] building {final} (once; ~1-2 min on 2 cores)")
        build_tiny_model(staging, cfg, log=log)
    try:
        staging.rename(final)
    except OSError:  # another process finished first: use theirs
        shutil.rmtree(staging, ignore_errors=True)
    return final
