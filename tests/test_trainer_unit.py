"""Trainer pieces that need no process group: config validation, the LoRA context, init, PEFT files."""
from __future__ import annotations

import json

import pytest
import torch

from marlaas_hpc.tasks.spec import LoraSpec, SpecError
from marlaas_hpc.trainer.lora import LoraContext, kaiming_uniform_a, peft_key
from marlaas_hpc.trainer.peft_io import read_peft_adapter, write_peft_adapter
from marlaas_hpc.trainer.trainer import TrainerConfig


def test_trainer_config_names_the_bad_field(tiny_model_path, tmp_path):
    assert TrainerConfig(model_path=str(tiny_model_path)).validate().tensor_parallel == 1
    cases = [({"model_path": str(tmp_path)}, "model_path"),
             ({"model_path": str(tiny_model_path), "tensor_parallel": 0}, "tensor_parallel"),
             ({"model_path": str(tiny_model_path), "micro_batch_tokens": -1}, "micro_batch_tokens"),
             ({"model_path": str(tiny_model_path), "seed": 1.5}, "seed"),
             ({"model_path": str(tiny_model_path), "device": "tpu"}, "device"),
             ({"model_path": str(tiny_model_path), "device": "cuda:x"}, "device"),
             ({"model_path": str(tiny_model_path), "dtype": "float16"}, "dtype"),
             ({"model_path": str(tiny_model_path), "recompute": "yes"}, "recompute")]
    if not torch.cuda.is_available():
        cases.append(({"model_path": str(tiny_model_path), "device": "cuda:0"}, "device"))
    for kwargs, field in cases:
        with pytest.raises(SpecError) as info:
            TrainerConfig(**kwargs).validate()
        assert info.value.field == field


def test_lora_context_groups_rows_by_adapter():
    ctx = LoraContext()
    cpu = torch.device("cpu")
    assert ctx.groups(cpu) == []
    with ctx.use("a", batch=3):
        assert ctx.groups(cpu) == [("a", None)]  # one adapter on every row: no indexing
        with ctx.use(["a", None, "b", "a"]):
            groups = {name: rows.tolist() for name, rows in ctx.groups(cpu)}
            assert groups == {"a": [0, 3], "b": [2]}  # row 1 is base only
        assert ctx.rows == ("a", "a", "a")  # restored on exit
    with ctx.use(None, batch=2):
        assert ctx.groups(cpu) == []
    with pytest.raises(ValueError):
        with ctx.use("a"):
            pass


def test_lora_context_runs_are_contiguous_rows_per_adapter():
    ctx = LoraContext()
    with ctx.use(["a", "a", None, "b", "b", "b"]):
        assert ctx.runs == [("a", 0, 2), (None, 2, 3), ("b", 3, 6)]
    with ctx.use(["a", "b", "a"]):
        assert ctx.runs is None  # a's rows are not one run: the hook indexes rows instead
    with ctx.use([None, "a", None]):
        assert ctx.runs == [(None, 0, 1), ("a", 1, 2), (None, 2, 3)]


def test_contiguous_runs_give_the_same_logits_and_grads_as_indexing(tiny_model_path, monkeypatch):
    """The hook's contiguous path (views of each task's rows, one add) equals per-adapter index_add exactly."""
    from marlaas_hpc.tasks import AlgoSpec
    from marlaas_hpc.trainer.trainer import MultiLoraTrainer

    trainer = MultiLoraTrainer(TrainerConfig(model_path=str(tiny_model_path)))
    for name, rank in (("ra", 4), ("rb", 8)):
        if name not in trainer.tasks:
            trainer.add_task(name, LoraSpec(rank=rank, alpha=2.0 * rank), AlgoSpec())
        with torch.no_grad():  # non-zero B: the adapters act
            for param in trainer.lora.parameters(name):
                param.add_(torch.randn_like(param) * 0.05)
    rows = ["ra"] * 3 + [None] * 2 + ["rb"] * 3
    ids = torch.randint(3, 100, (len(rows), 10))

    def logits_and_grads():
        for name in ("ra", "rb"):
            trainer.tasks[name].optimizer.zero_grad(set_to_none=True)
        with trainer.lora.ctx.use(rows):
            logits = trainer._forward(ids)
        logits.float().square().mean().backward()
        grads = [p.grad.clone() for name in ("ra", "rb") for p in trainer.lora.parameters(name)]
        return logits.detach(), grads

    with trainer.lora.ctx.use(rows):
        assert trainer.lora.ctx.runs is not None
    contiguous = logits_and_grads()
    monkeypatch.setattr(LoraContext, "runs", property(lambda self: None))
    indexed = logits_and_grads()
    assert torch.equal(contiguous[0], indexed[0])
    assert all(torch.allclose(a, b, rtol=1e-6, atol=1e-9) for a, b in zip(contiguous[1], indexed[1]))
    base = trainer.logits(None, ids[3:5])  # rows 3-4 use no adapter
    assert float((contiguous[0][3:5, :, : trainer.vocab_size] - base).abs().max()) < 1e-5
    for name in ("ra", "rb"):
        trainer.remove_task(name)


def test_lora_a_init_is_seeded_and_peft_scaled():
    a = kaiming_uniform_a(8, 128, seed=3)
    assert torch.equal(a, kaiming_uniform_a(8, 128, seed=3))
    assert not torch.equal(a, kaiming_uniform_a(8, 128, seed=4))
    assert a.abs().max() <= 1 / 128 ** 0.5 and a.abs().max() > 0.8 / 128 ** 0.5


def test_peft_keys_match_what_peft_writes(make_lora_adapter):
    from safetensors.torch import load_file

    written = set(load_file(str(make_lora_adapter("keys") / "adapter_model.safetensors")))
    ours = {peft_key(layer, m, w) for layer in range(4) for m in LoraSpec().target_modules for w in "AB"}
    assert ours == written


def test_peft_files_round_trip_and_replace_atomically(tmp_path):
    spec = LoraSpec(rank=2, alpha=6.0, target_modules=("v_proj", "q_proj"))
    tensors = {peft_key(0, "q_proj", "A"): torch.randn(2, 8), peft_key(0, "q_proj", "B"): torch.randn(8, 2)}
    out = tmp_path / "adapter"
    write_peft_adapter(out, tensors, spec, base_model_name_or_path="base")
    tensors[peft_key(0, "q_proj", "B")] = torch.ones(8, 2)
    write_peft_adapter(out, tensors, spec, base_model_name_or_path="base")  # replaces in place
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"]  # no staging leftovers
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["peft_type"], config["task_type"]) == (2, 6.0, "LORA",
                                                                                           "CAUSAL_LM")
    assert config["base_model_name_or_path"] == "base" and config["lora_dropout"] == 0.0
    read_spec, read_tensors = read_peft_adapter(out)
    assert (read_spec.rank, read_spec.alpha, set(read_spec.target_modules)) == (2, 6.0, {"q_proj", "v_proj"})
    assert torch.equal(read_tensors[peft_key(0, "q_proj", "B")], torch.ones(8, 2))


def test_read_peft_rejects_unsupported_variants(tmp_path):
    spec = LoraSpec(rank=2, alpha=2.0, target_modules=("q_proj",))
    out = write_peft_adapter(tmp_path / "dora", {peft_key(0, "q_proj", "A"): torch.zeros(2, 4)}, spec)
    config = json.loads((out / "adapter_config.json").read_text())
    config["use_dora"] = True
    (out / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="use_dora"):
        read_peft_adapter(out)


def test_zero_advantage_rows_are_skipped_and_the_update_is_the_same(tiny_model_path, monkeypatch):
    """Rows whose advantage is 0 (a group whose samples all got one reward) are not run; over three fused steps
    (Adam moments built up) the adapters, optimizer state and loss equal those of running every row, for a task
    with some such groups and for one with nothing but (its AdamW still steps on a zero gradient)."""
    import random

    from marlaas_hpc.tasks import AlgoSpec
    from marlaas_hpc.trainer.trainer import MultiLoraTrainer
    from marlaas_hpc.trajectory import Trajectory, assign_advantages

    trainer = MultiLoraTrainer(TrainerConfig(model_path=str(tiny_model_path)))
    rng = random.Random(7)
    torch.manual_seed(7)

    def batch(task_id: str, rewards_per_group: list[list[float]]) -> list[Trajectory]:
        out = []
        for g, rewards in enumerate(rewards_per_group):
            prompt = [rng.randrange(3, 100) for _ in range(rng.randrange(3, 7))]
            for reward in rewards:
                completion = [rng.randrange(3, 100) for _ in range(rng.randrange(2, 6))]
                out.append(Trajectory(task_id, f"{task_id}/g{g}", prompt, completion,
                                      [-rng.random() for _ in completion], 0, reward=reward))
        assign_advantages(out, normalize_std=True)
        return out

    batches = [{"some": batch("some", [[1, 0, 0, 1], [1, 1, 1, 1], [0, 1, 0, 0], [0, 0, 0, 0]]),
                "none": batch("none", [[1, 1, 1, 1], [0, 0, 0, 0]])} for _ in range(3)]
    for name in ("some", "none"):
        trainer.add_task(name, LoraSpec(rank=4, alpha=8.0), AlgoSpec(lr=0.01, weight_decay=0.1))
        with torch.no_grad():  # non-zero B: every step moves the adapters
            for param in trainer.lora.parameters(name):
                param.add_(torch.randn_like(param) * 0.05)
    start = {name: trainer.state_dict(name) for name in ("some", "none")}

    def run() -> tuple[list[dict], dict]:
        for name, state in start.items():
            trainer.load_state_dict(name, state)
        metrics = [trainer.train_steps(step) for step in batches]
        return metrics, {name: trainer.state_dict(name) for name in start}

    skipped_metrics, skipped = run()
    monkeypatch.setattr(MultiLoraTrainer, "_contributes", lambda self, task_id, traj: True)
    every_metrics, every = run()
    assert [m["some"]["skipped_rows"] for m in skipped_metrics] == [8.0] * 3
    assert [m["none"]["skipped_rows"] for m in skipped_metrics] == [8.0] * 3
    for name in start:
        for key, tensor in every[name]["adapter"].items():
            # packed rows hold other sequences when rows are skipped: float sums in another order, which Adam
            # turns into up to ~1e-4 for a weight whose gradient is ~0; a missed step or a wrong token count
            # moves weights by the learning rate, 1e-2 (the loss and gradient norm are compared tightly below)
            assert torch.allclose(skipped[name]["adapter"][key], tensor, rtol=1e-4, atol=2e-4), (name, key)
        assert not torch.equal(every[name]["adapter"][next(iter(every[name]["adapter"]))],
                               start[name]["adapter"][next(iter(start[name]["adapter"]))])  # they did move
        for state_a, state_b in zip(skipped[name]["optimizer"]["state"].values(),
                                    every[name]["optimizer"]["state"].values()):
            for key in ("exp_avg", "exp_avg_sq"):  # relative to the largest entry: second moments are ~1e-10
                scale = float(state_b[key].abs().max())
                assert float((state_a[key] - state_b[key]).abs().max()) <= 1e-3 * scale, (name, key)
    for fast, full in zip(skipped_metrics, every_metrics):
        assert fast["some"]["loss"] == pytest.approx(full["some"]["loss"], rel=1e-5, abs=1e-9)
        assert fast["some"]["grad_norm"] == pytest.approx(full["some"]["grad_norm"], rel=1e-4)
        assert fast["none"]["loss"] == 0.0 == full["none"]["loss"]
    for name in start:
        trainer.remove_task(name)


def test_packed_sequences_get_the_logprobs_each_gets_alone(tiny_model_path):
    """Samples of one task packed into shared rows, each prompt once for its samples (trainer/packing.py), score
    their completions as each sequence does alone: no token sees another sequence, and every token has the RoPE
    position it has alone."""
    import random

    from marlaas_hpc.tasks import AlgoSpec
    from marlaas_hpc.trainer.trainer import MultiLoraTrainer
    from marlaas_hpc.trajectory import Trajectory

    trainer = MultiLoraTrainer(TrainerConfig(model_path=str(tiny_model_path)))
    trainer.add_task("pk", LoraSpec(rank=4, alpha=8.0), AlgoSpec())
    with torch.no_grad():
        for param in trainer.lora.parameters("pk"):
            param.add_(torch.randn_like(param) * 0.05)
    rng = random.Random(3)
    trajs = []
    for group in range(5):  # 3 samples of each prompt
        prompt = [rng.randrange(3, 100) for _ in range(rng.randrange(2, 12))]
        for _ in range(3):
            completion = [rng.randrange(3, 100) for _ in range(rng.randrange(1, 9))]
            trajs.append(Trajectory("pk", f"pk/g{group}", prompt, completion, [0.0] * len(completion), 0))
    packed = trainer._pack([("pk", traj) for traj in trajs])
    placed = int((packed.ids != trainer.pad_id).sum())
    once = sum(len(t.prompt_ids) for t in trajs[::3]) + sum(len(t.completion_ids) for t in trajs)
    alone = sum(len(t.prompt_ids) + len(t.completion_ids) for t in trajs)
    # a prompt repeats only in another row (rows are 32 tokens here: a prompt and its 3 samples may not fit one)
    assert once <= placed < alone - 60, "prompts are shared by their samples"
    assert len(packed.tasks) < len(trajs)
    got = trainer.logprobs("pk", trajs, temperature=0.7)
    for traj, logprobs in zip(trajs, got):
        ids = traj.prompt_ids + traj.completion_ids
        alone = torch.log_softmax(trainer.logits("pk", [ids])[0].float() / 0.7, dim=-1)
        want = [float(alone[len(traj.prompt_ids) - 1 + j, token]) for j, token in enumerate(traj.completion_ids)]
        assert logprobs == pytest.approx(want, abs=1e-5)
    trainer.remove_task("pk")


def test_recompute_reruns_every_layer_in_backward(tiny_model_path):
    """`recompute: true` recomputes: in a training step each decoder layer's forward runs twice (the forward, and
    again inside backward), once without recompute; loss and gradients are the same either way. megatron
    recomputes only in train mode, and a frozen embedding's output must require grad for its reentrant
    checkpoint to run the layers' backward at all."""
    import random

    from marlaas_hpc.tasks import AlgoSpec
    from marlaas_hpc.trainer.trainer import MultiLoraTrainer
    from marlaas_hpc.trajectory import Trajectory, assign_advantages

    rng = random.Random(4)
    trajs = []
    for group in range(3):
        prompt = [rng.randrange(3, 100) for _ in range(rng.randrange(3, 9))]
        for _ in range(4):
            completion = [rng.randrange(3, 100) for _ in range(rng.randrange(2, 9))]
            trajs.append(Trajectory("rc", f"rc/g{group}", prompt, completion, [-4.0] * len(completion), 0,
                                    reward=float(rng.random() < 0.5)))
    assign_advantages(trajs)
    runs = {}
    for recompute in (False, True):
        trainer = MultiLoraTrainer(TrainerConfig(model_path=str(tiny_model_path), seed=2, recompute=recompute))
        trainer.add_task("rc", LoraSpec(rank=4, alpha=8.0), AlgoSpec(lr=1e-2))  # kl_beta 0: no base forward
        torch.manual_seed(2)
        with torch.no_grad():
            for param in trainer.lora.parameters("rc"):
                param.add_(torch.randn_like(param) * 0.05)
        calls = [0] * len(trainer.model.decoder.layers)
        hooks = [layer.register_forward_pre_hook(lambda module, args, i=i: calls.__setitem__(i, calls[i] + 1))
                 for i, layer in enumerate(trainer.model.decoder.layers)]
        metrics = trainer.train_step("rc", trajs)
        for hook in hooks:
            hook.remove()
        runs[recompute] = calls, metrics, trainer.adapter_tensors("rc", grads=True)
        assert not trainer.model.training  # back in eval mode after the step
        trainer.close()
    assert runs[False][0] == [1] * len(runs[False][0]) and runs[True][0] == [2] * len(runs[True][0]), \
        (runs[False][0], runs[True][0])
    assert runs[True][1]["loss"] == pytest.approx(runs[False][1]["loss"], rel=1e-6)
    for key, grad in runs[False][2].items():
        assert grad.abs().max() > 0 or "lora_A" in key
        assert torch.allclose(runs[True][2][key], grad, rtol=1e-5, atol=1e-8), key


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lm_head_logprobs_equal_the_full_softmax_and_keep_no_vocab_wide_tensor(monkeypatch, dtype):
    """LmHead.logprobs (chunks of tokens, logits recomputed in backward) equals log_softmax over float64 logits of
    the same weights, values and hidden-state gradients, at T != 1 with megatron's padding columns; what it keeps
    for backward has no vocabulary-wide dimension."""
    from types import SimpleNamespace

    from megatron.core import parallel_state

    from marlaas_hpc.trainer import lm_head
    from marlaas_hpc.trainer.model import init_distributed

    init_distributed(1)
    torch.manual_seed(0)
    padded, vocab, width, tokens, temperature = 384, 371, 16, 37, 0.7
    weight = (torch.randn(padded, width) * 2).to(dtype)
    model = SimpleNamespace(share_embeddings_and_output_weights=False, output_layer=SimpleNamespace(weight=weight))
    head = lm_head.LmHead(model, parallel_state.get_tensor_model_parallel_group(), vocab)
    monkeypatch.setattr(lm_head, "LOGITS_CHUNK_BYTES", 4 * padded * 5)  # 5 tokens a chunk: 8 chunks
    hidden = torch.randn(tokens, width).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,))
    upstream = torch.randn(tokens)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        got = head.logprobs(hidden, labels, temperature)
    (got * upstream).sum().backward()
    activations = [tuple(t.shape) for t in saved if t is not weight]  # the (frozen) weight is no activation
    assert got.dtype == torch.float32 and activations and not any(padded in s or vocab in s for s in activations)
    reference_hidden = hidden.detach().double().requires_grad_()
    logits = reference_hidden @ weight[:vocab].double().t() / temperature
    want = torch.log_softmax(logits, dim=-1).gather(1, labels.unsqueeze(1)).squeeze(1)
    (want * upstream).sum().backward()
    assert float((got.double() - want).abs().max()) < 1e-4
    grad_tol = 1e-5 if dtype == torch.float32 else 2e-2  # the hidden states' gradient is in the base dtype
    scale = float(reference_hidden.grad.abs().max())
    assert float((hidden.grad.double() - reference_hidden.grad).abs().max()) < grad_tol * scale


def test_lora_down_projection_keeps_bf16_activations_for_backward():
    """A LoRA site's float32 A·x from bf16 activations keeps x itself for backward, not a float32 copy (half the
    bytes at every site of every layer), with the gradients of F.linear(x.float(), A)."""
    from marlaas_hpc.trainer.lora import _Float32Down

    torch.manual_seed(0)
    x = torch.randn(7, 3, 64).to(torch.bfloat16).requires_grad_()
    a = torch.randn(8, 64, requires_grad=True)
    upstream = torch.randn(7, 3, 8)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = _Float32Down.apply(x, a)
    (out * upstream).sum().backward()
    assert out.dtype == torch.float32
    assert sorted(str(t.dtype) for t in saved) == ["torch.bfloat16", "torch.float32"] and saved[0] is x
    x_ref = x.detach().clone().requires_grad_()
    a_ref = a.detach().clone().requires_grad_()
    ref = torch.nn.functional.linear(x_ref.float(), a_ref)
    (ref * upstream).sum().backward()
    assert torch.equal(out, ref)
    assert torch.allclose(a.grad, a_ref.grad, rtol=1e-5, atol=1e-6) and torch.equal(x.grad, x_ref.grad)
