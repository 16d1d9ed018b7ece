"""One trainer run per TP size, executed in spawned gloo processes; the trainer tests compare its records.

A single scenario per TP size keeps the (slow: ~10 s) megatron import + model build to one per process; the
`*_per_checkpoint` runners go further and run one checkpoint's scenario after another in the same processes, so
that every checkpoint shares one import. Rank 0 returns the full record; every rank returns its own isolation checks.
"""
from __future__ import annotations

import random
from pathlib import Path

import torch

from marlaas_hpc.tasks.spec import AlgoSpec, LoraSpec
from marlaas_hpc.trajectory import Trajectory
from support.local_group import per_checkpoint

# task id -> (LoRA shape, GRPO settings). b and c target strict subsets of the fused q/k/v and gate/up sites.
TASKS = {
    "a": (LoraSpec(rank=4, alpha=8.0), AlgoSpec(lr=5e-3, kl_beta=0.05)),
    "b": (LoraSpec(rank=2, alpha=4.0, target_modules=("q_proj", "v_proj")), AlgoSpec(lr=5e-3, temperature=0.7)),
    "c": (LoraSpec(rank=3, alpha=3.0, target_modules=("k_proj", "up_proj", "down_proj")), AlgoSpec(lr=5e-3)),
}
FUSED_STEPS = 3
BF16_LOGPROB_MEAN_TOL = 0.01
"""bf16 base weights vs float32: mean |logprob difference| per token (nats); measured 0.0018 on
random:qwen3-0.6b-mini (CPU). The GPU test holds the GPU to the same bounds."""
BF16_LOGPROB_MAX_TOL = 0.05
"""... and the largest single-token difference (nats); measured 0.0064."""
TINY_PROBE_IDS = [[5, 9, 17, 33, 65, 100, 101, 7, 8, 44], [12, 13, 14, 15, 16, 90, 91, 92, 93, 94]]


SPECIAL_PROBE_IDS = {151936: (151644, 151645, 151643), 128256: (128000, 128009, 128006)}
"""Per real vocabulary (Qwen, Llama 3): special ids the probe rows hold."""
PROBE_LENGTH = 64
"""Tokens per probe row on a real vocabulary: far enough from position 0 that a RoPE without Llama 3's frequency
scaling shows in the logits (4e-4 at 64 positions on random:llama3.2-1b-mini, above LOGIT_TOL)."""


def probe_ids(vocab: int) -> list[list[int]]:
    """Two probe rows; on a real vocabulary they include the family's special ids and the last rows, which sit
    in the last TP shard next to megatron's padding."""
    if vocab <= 128:
        return TINY_PROBE_IDS
    first, second, third = SPECIAL_PROBE_IDS[vocab]
    rows = [[5, 900, first, second, third, vocab - 1, 3, 77, 4000, 12],
            [first, 20, 30, 40, 50, 60, vocab - 2, 2000, second, 9]]
    rng = random.Random(vocab)
    return [row + [rng.randrange(3, 4000) for _ in range(PROBE_LENGTH - len(row))] for row in rows]


def _token(rng: random.Random, vocab: int) -> int:
    if vocab <= 128 or rng.random() < 0.8:
        return rng.randrange(3, min(vocab, 4096))
    return rng.randrange(vocab - 400, vocab)  # special tokens and the rows next to the vocabulary padding


def make_trajectories(task_id: str, seed: int, n: int = 8, vocab: int = 128) -> list[Trajectory]:
    """Random token sequences (behaviour logprobs filled in later from the HF base model)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [_token(rng, vocab) for _ in range(rng.randrange(3, 9))]
        completion = [_token(rng, vocab) for _ in range(rng.randrange(2, 9))]
        mask = None
        if i % 3 == 2:  # a multi-turn episode: a tool observation in the middle is not trained
            mask = [1] * len(completion)
            mask[len(completion) // 2] = 0
        out.append(Trajectory(task_id=task_id, group_id=f"{task_id}-g{i // 4}", prompt_ids=prompt,
                              completion_ids=completion, behaviour_logprobs=[0.0] * len(completion),
                              behaviour_version=0, reward=float(rng.random() < 0.5), loss_mask=mask))
    return out


def _params_equal(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> bool:
    return before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def _optimizer_tensors(trainer, task_id: str) -> dict[str, torch.Tensor]:
    state = trainer.tasks[task_id].optimizer.state_dict()["state"]
    return {f"{i}.{k}": v.clone() for i, s in state.items() for k, v in s.items() if torch.is_tensor(v)}


def base_logits(rank: int, model_path: str, tp: int, probe: list[list[int]]) -> dict:
    """Only the base model's logits (a TP size too costly for the whole scenario)."""
    from marlaas_hpc.trainer.trainer import MultiLoraTrainer, TrainerConfig

    # float32 whatever the device: the callers compare with float32 transformers ('auto' is bfloat16 on CUDA)
    trainer = MultiLoraTrainer(TrainerConfig(model_path=model_path, tensor_parallel=tp, dtype="float32"))
    return {"base_logits": trainer.logits(None, probe)}


def base_logits_per_checkpoint(rank: int, runs: dict[str, tuple]) -> dict[str, dict]:
    """`base_logits` of each checkpoint (args: model_path, tp, probe) in this process."""
    return per_checkpoint(base_logits, rank, runs)


def scenario_per_checkpoint(rank: int, runs: dict[str, tuple]) -> dict[str, dict]:
    """`run_scenario` of each checkpoint (args as run_scenario's after the rank) in this process."""
    return per_checkpoint(run_scenario, rank, runs)


def run_scenario(rank: int, model_path: str, tp: int, batches: dict[str, list[Trajectory]], out_dir: str,
                 micro_batch_tokens: int, probe: list[list[int]]) -> dict:
    import time

    start = time.perf_counter()
    from marlaas_hpc.trainer.cpu_shims import apply_cpu_shims
    from marlaas_hpc.trainer.trainer import MultiLoraTrainer, TrainerConfig

    imported = time.perf_counter()
    trainer = MultiLoraTrainer(TrainerConfig(model_path=model_path, tensor_parallel=tp, seed=7,
                                             micro_batch_tokens=micro_batch_tokens))
    record: dict = {"shims_idempotent": apply_cpu_shims() and apply_cpu_shims(),
                    "rope_inv_freq": trainer.model.rotary_pos_emb.inv_freq.cpu()}
    built = time.perf_counter()
    base_before = {k: v.detach().clone() for k, v in trainer.model.state_dict().items() if torch.is_tensor(v)}
    record["base_logits"] = trainer.logits(None, probe)
    for task_id, (lora, algo) in TASKS.items():
        trainer.add_task(task_id, lora, algo)
    record["init_tensors"] = {t: trainer.adapter_tensors(t) for t in TASKS}

    # isolation: training a alone leaves b and c (weights, optimizer state) bit-identical
    others_before = {t: trainer.lora.local_state_dict(t) for t in ("b", "c")}
    record["isolation_metrics"] = trainer.train_step("a", batches["a"])
    record["others_untouched"] = all(_params_equal(others_before[t], trainer.lora.local_state_dict(t))
                                     for t in others_before)
    record["others_no_grad"] = all(p.grad is None for t in ("b", "c") for p in trainer.lora.parameters(t))

    record["steps"] = []
    for _ in range(FUSED_STEPS):
        metrics = trainer.train_steps(batches)
        grads = {t: trainer.adapter_tensors(t, grads=True) for t in TASKS}
        record["steps"].append({"metrics": metrics, "grads": grads})
    record["tensors"] = {t: trainer.adapter_tensors(t) for t in TASKS}
    record["versions"] = {t: trainer.version(t) for t in TASKS}

    # b only: a and c untouched, including Adam moments
    snapshot = {t: (trainer.lora.local_state_dict(t), _optimizer_tensors(trainer, t)) for t in ("a", "c")}
    trainer.train_step("b", batches["b"])
    record["isolation_b"] = all(_params_equal(snapshot[t][0], trainer.lora.local_state_dict(t))
                                and _params_equal(snapshot[t][1], _optimizer_tensors(trainer, t))
                                for t in snapshot)
    base_after = {k: v.detach() for k, v in trainer.model.state_dict().items() if torch.is_tensor(v)}
    record["base_untouched"] = _params_equal(base_before, base_after)

    record["logits"] = {t: trainer.logits(t, probe) for t in TASKS}
    record["mixed_logits"] = trainer.logits(["a", None], probe)
    record["logprobs"] = {t: trainer.logprobs(t, batches[t][:3], TASKS[t][1].temperature) for t in TASKS}
    record["exports"] = {t: str(trainer.export_adapter(t, Path(out_dir) / f"tp{tp}" / t)) for t in TASKS}

    # resume: a state_dict round trip reproduces the next step exactly
    saved = trainer.state_dict("a")
    first = trainer.train_step("a", batches["a"])
    after_first = trainer.lora.local_state_dict("a")
    trainer.load_state_dict("a", saved)
    second = trainer.train_step("a", batches["a"])
    record["resume_same_loss"] = first["loss"] == second["loss"] and first["version"] == second["version"]
    record["resume_same_weights"] = _params_equal(after_first, trainer.lora.local_state_dict("a"))

    # import: the exported c loaded as a new task gives c's logits
    trainer.load_adapter("c2", record["exports"]["c"], algo=TASKS["c"][1], version=trainer.version("c"))
    record["imported_logits_diff"] = float((trainer.logits("c2", probe) - record["logits"]["c"]).abs().max())
    trainer.remove_task("c2")
    record["task_ids"] = trainer.task_ids()
    trainer.close()
    record["seconds"] = {"import": imported - start, "build": built - imported, "run": time.perf_counter() - built}
    return record


MEMORY_VARIANTS = {
    "whole": {},
    "micro": {"micro_batch_tokens": 40},
    "recompute": {"micro_batch_tokens": 40, "recompute": True},
    "bf16": {"dtype": "bfloat16"},
    "megatron_wgrad": {},
}
"""TrainerConfig variants of one fused step from the same initial adapters (micro-batches of <= 40 padded
tokens split the 24 trajectories into several passes); 'megatron_wgrad' runs megatron's unpatched linear
backward (trainer/frozen_base.py skips the frozen weights' gradients). Each records the decoder layers' forward
calls in the step (`layer_forwards`): 'recompute' runs every layer again in backward."""


def memory_variants_scenario(rank: int, model_path: str, batches: dict[str, list[Trajectory]]) -> dict:
    """One fused multi-task step per variant of MEMORY_VARIANTS: metrics, gradients, and the logprobs of the
    batch before the step (base weights only differ in bf16)."""
    from marlaas_hpc.trainer.trainer import MultiLoraTrainer, TrainerConfig

    from megatron.core.tensor_parallel.layers import LinearWithGradAccumulationAndAsyncCommunication as Linear

    out = {}
    for name, kwargs in MEMORY_VARIANTS.items():
        trainer = MultiLoraTrainer(TrainerConfig(model_path=model_path, seed=7, **kwargs))
        if name == "megatron_wgrad":  # megatron's own backward, computing the frozen weights' gradients too
            Linear.backward = Linear.original_backward
        for task_id, (lora, algo) in TASKS.items():
            trainer.add_task(task_id, lora, algo)
        logprobs = {t: trainer.logprobs(t, batches[t], TASKS[t][1].temperature) for t in TASKS}
        calls = [0]
        hooks = [layer.register_forward_pre_hook(lambda module, args: calls.__setitem__(0, calls[0] + 1))
                 for layer in trainer.model.decoder.layers]
        metrics = trainer.train_steps(batches)
        for hook in hooks:
            hook.remove()
        out[name] = {"metrics": metrics, "grads": {t: trainer.adapter_tensors(t, grads=True) for t in TASKS},
                     "logprobs": logprobs, "layer_forwards": calls[0],
                     "lora_dtypes": sorted({str(p.dtype) for t in TASKS for p in trainer.lora.parameters(t)}),
                     "base_dtype": str(next(trainer.model.parameters()).dtype)}
        trainer.close()
    return out


def train_and_export_scenario(rank: int, model_path: str, tp: int, batch: list[Trajectory], out_dir: str) -> dict:
    """Task 'a' after one GRPO step (its adapter is no longer the base), exported as v1 in PEFT format."""
    from marlaas_hpc.trainer.trainer import MultiLoraTrainer, TrainerConfig

    trainer = MultiLoraTrainer(TrainerConfig(model_path=model_path, tensor_parallel=tp, seed=3))
    lora, algo = TASKS["a"]
    trainer.add_task("a", lora, algo)
    trainer.train_step("a", batch)
    return {"export": str(trainer.export_adapter("a", out_dir)), "version": trainer.version("a")}


def train_tensors_scenario(rank: int, model_path: str, tp: int, batch: list[Trajectory], out_dir: str) -> dict:
    """Task 'a''s adapter tensors as the trainer leader broadcasts them (`adapter_tensors`) at v0 (new) and v1
    (after one GRPO step), and v1 exported in PEFT format."""
    from marlaas_hpc.trainer.trainer import MultiLoraTrainer, TrainerConfig

    trainer = MultiLoraTrainer(TrainerConfig(model_path=model_path, tensor_parallel=tp, seed=3))
    lora, algo = TASKS["a"]
    trainer.add_task("a", lora, algo)
    v0 = trainer.adapter_tensors("a")
    trainer.train_step("a", batch)
    return {"v0": v0, "v1": trainer.adapter_tensors("a"), "version": trainer.version("a"),
            "export": str(trainer.export_adapter("a", out_dir))}


def logprobs_scenario(rank: int, model_path: str, tp: int, adapter: str, version: int,
                      trajectories: list[Trajectory], temperature: float) -> dict:
    """The trainer's logprobs of given completions with a PEFT adapter loaded at `version`, and the base
    model's (no adapter)."""
    from marlaas_hpc.trainer.trainer import MultiLoraTrainer, TrainerConfig

    trainer = MultiLoraTrainer(TrainerConfig(model_path=model_path, tensor_parallel=tp, seed=3))
    trainer.load_adapter("a", adapter, algo=TASKS["a"][1], version=version)
    return {"logprobs": trainer.logprobs("a", trajectories, temperature), "version": trainer.version("a"),
            "base": trainer.logprobs(None, trajectories, temperature)}


HEAD_MEAN_TOL = 1e-4
"""float32 LM head vs float64 on the same hidden states: mean |logprob difference| per token (nats). Measured on
CPU: 2.7e-6 (logprobs) with the float32 head, 0.047 with the bf16 head it replaced."""
HEAD_MAX_TOL = 1e-3
"""... and the largest single-token difference: 6.9e-6 float32, 0.13 bf16."""
NORM_SCALE = 40.0
"""Final-norm gain of `scaled_checkpoint`: random:qwen3-0.6b-mini's logits have std ~0.3; x40 puts the top ones
at 40-50, a trained model's magnitudes."""


def scaled_checkpoint(out_dir: str | Path) -> Path:
    """random:qwen3-0.6b-mini with every weight rounded to bf16 (as released checkpoints are) and its final norm
    scaled by NORM_SCALE, written to `out_dir`."""
    import shutil

    from safetensors.torch import load_file, save_file

    from marlaas_hpc.model.random_checkpoints import ensure_random_checkpoint

    source, out = ensure_random_checkpoint("qwen3-0.6b-mini"), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        if path.name != "model.safetensors":
            shutil.copy(path, out / path.name)
    tensors = load_file(str(source / "model.safetensors"))
    tensors["model.norm.weight"] = tensors["model.norm.weight"] * NORM_SCALE
    save_file({k: v.to(torch.bfloat16).float() for k, v in tensors.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    return out


def _float64_head_logprobs(trainer, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """float64 log softmax of (hidden @ head weight) at `targets`: hidden [n, h] as the trainer computed it."""
    weight = trainer.model.shared_embedding_or_output_weight()[: trainer.vocab_size].double()
    logits = hidden.double() @ weight.t()
    return torch.log_softmax(logits, dim=-1).gather(1, targets.unsqueeze(1)).squeeze(1)


def head_inputs() -> tuple[list[list[int]], list[Trajectory]]:
    """Probe rows (24 tokens each) and 8 trajectories for `head_precision_scenario`."""
    rng = random.Random(0)
    probe = [[rng.randrange(3, 4000) for _ in range(24)] for _ in range(3)]
    return probe, make_trajectories("a", seed=5, n=8, vocab=151936)


def head_precision_scenario(rank: int, model_path: str, dtype: str, probe: list[list[int]],
                            trajectories: list[Trajectory]) -> dict:
    """The trainer's logprobs against a float64 LM head applied to its own final hidden states (captured from
    the same forward): |difference| per token of `logits` (probe rows, each next token) and of `logprobs`
    (packed rows, the training path), and the probe's top logits."""
    from marlaas_hpc.trainer.trainer import MultiLoraTrainer, TrainerConfig

    trainer = MultiLoraTrainer(TrainerConfig(model_path=model_path, dtype=dtype))
    captured = []
    trainer.model.decoder.register_forward_hook(lambda module, args, out: captured.append(out.detach()))
    logits = trainer.logits(None, probe).double()
    hidden = captured[-1].transpose(0, 1)  # [rows, s, h]
    targets = torch.tensor(probe, device=logits.device)[:, 1:]
    got = torch.log_softmax(logits[:, :-1], dim=-1).gather(2, targets.unsqueeze(2)).squeeze(2).reshape(-1)
    want = _float64_head_logprobs(trainer, hidden[:, :-1].reshape(-1, hidden.shape[-1]), targets.reshape(-1))
    record = {"top_logits": logits.max(dim=-1).values.cpu(), "logits_diff": (got - want).abs().cpu()}
    captured.clear()
    got = torch.tensor([x for logprobs in trainer.logprobs(None, trajectories) for x in logprobs],
                       dtype=torch.float64)
    batch = trainer._pack([(None, traj) for traj in trajectories])  # the layout logprobs packed
    want = _float64_head_logprobs(trainer, captured[0][batch.token_source, batch.token_row], batch.targets)
    record.update(logprobs_diff=(got - want.cpu()).abs(), forwards=len(captured))
    trainer.close()
    return record


ATTENTION_VARIANTS = {"dense": {"attention": "dense"}, "flex": {"attention": "flex"},
                      "flex_recompute": {"attention": "flex", "recompute": True}}
"""TrainerConfig variants of `attention_kernels_scenario` (float32 base weights: the kernels compared exactly)."""


def long_trajectories(task_id: str, length: int, vocab: int) -> list[Trajectory]:
    """Two samples of one 100-token prompt with `length`-token completions: rows of `length` + 100 tokens."""
    rng = random.Random(length)
    prompt = [rng.randrange(3, 4000) for _ in range(100)]
    out = []
    for sample in range(2):
        completion = [rng.randrange(3, min(vocab, 4000)) for _ in range(length)]
        out.append(Trajectory(task_id=task_id, group_id=f"{task_id}-long", prompt_ids=prompt,
                              completion_ids=completion, behaviour_logprobs=[-11.9] * length, behaviour_version=0,
                              reward=float(sample)))
    return out


def attention_kernels_scenario(rank: int, model_path: str, batches: dict[str, list[Trajectory]],
                               long_batch: list[Trajectory]) -> dict:
    """Per ATTENTION_VARIANTS entry (CUDA: FlexAttention trains on CUDA only): the logprobs before, metrics and
    gradients of one fused step of TASKS, and the peak device memory of a step of task 'a' on `long_batch`
    above what was allocated before it."""
    from marlaas_hpc.trainer.trainer import MultiLoraTrainer, TrainerConfig

    out = {}
    for name, kwargs in ATTENTION_VARIANTS.items():
        trainer = MultiLoraTrainer(TrainerConfig(model_path=model_path, seed=7, dtype="float32", **kwargs))
        for task_id, (lora, algo) in TASKS.items():
            trainer.add_task(task_id, lora, algo)
        logprobs = {t: trainer.logprobs(t, batches[t], TASKS[t][1].temperature) for t in TASKS}
        metrics = trainer.train_steps(batches)
        grads = {t: trainer.adapter_tensors(t, grads=True) for t in TASKS}
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        trainer.train_step("a", long_batch)
        torch.cuda.synchronize()
        out[name] = {"logprobs": logprobs, "metrics": metrics, "grads": grads,
                     "long_step_peak": torch.cuda.max_memory_allocated() - before,
                     "kernel": trainer.attention.kind}
        trainer.close()
        del trainer
        torch.cuda.empty_cache()
    return out
