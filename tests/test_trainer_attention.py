"""Packed rows' attention kernels (trainer/attention.py) on CPU, float32, the tiny model (GQA: 4 heads, 2 KV
heads): FlexAttention's forward equals megatron's dense path layer by layer on rows that hold several prompts,
prompts shared by several completions, and padding, at row widths below, at and beyond one FlexAttention block;
the flex path builds no dense mask; settings are validated. FlexAttention's backward runs on CUDA only
(torch 2.13): tests/test_gpu_trainer.py trains with it."""
from __future__ import annotations

import random

import pytest
import torch

from marlaas_hpc.tasks import AlgoSpec, LoraSpec, SpecError
from marlaas_hpc.trainer.attention import PADDING, resolve_attention
from marlaas_hpc.trajectory import Trajectory

TOL = 1e-5
TASKS = ("ka", "kb")


def _trajectories(seed: int, prompts: int, samples: int, longest: int) -> list[tuple[str, Trajectory]]:
    rng = random.Random(seed)
    items = []
    for task in TASKS:
        for group in range(prompts):
            prompt = [rng.randrange(3, 100) for _ in range(rng.randrange(2, 12))]
            for _ in range(samples):
                completion = [rng.randrange(3, 100) for _ in range(rng.randrange(1, longest))]
                items.append((task, Trajectory(task, f"{task}/g{group}", prompt, completion,
                                               [0.0] * len(completion), 0)))
    return items


@pytest.fixture(scope="module")
def trainers(tiny_model_path):
    """{kind: trainer} with the same two non-zero adapters."""
    from marlaas_hpc.trainer.trainer import MultiLoraTrainer, TrainerConfig

    out = {}
    for kind in ("dense", "flex"):
        trainer = MultiLoraTrainer(TrainerConfig(model_path=str(tiny_model_path), seed=3, attention=kind))
        torch.manual_seed(3)
        for task in TASKS:
            trainer.add_task(task, LoraSpec(rank=4, alpha=8.0), AlgoSpec())
            with torch.no_grad():
                for param in trainer.lora.parameters(task):
                    param.add_(torch.randn_like(param) * 0.05)
        out[kind] = trainer
    yield out
    for trainer in out.values():
        trainer.close()


def _run(trainer, batch):
    """Each layer's core-attention output and the trained tokens' logprobs of one packed batch."""
    outputs = []
    hooks = [layer.self_attention.core_attention.register_forward_hook(lambda m, a, out: outputs.append(out))
             for layer in trainer.model.decoder.layers]
    try:
        with torch.no_grad(), trainer.lora.ctx.use(batch.tasks), \
                trainer.attention.use(trainer.attention.mask(batch.prompt_of, batch.own)) as mask:
            logprobs = trainer._token_logprobs(trainer._trained_hidden(batch, mask), batch.targets, 1.0)
    finally:
        for hook in hooks:
            hook.remove()
    return outputs, logprobs


@pytest.mark.parametrize("width,longest", [(32, 9), (128, 20), (200, 40)])
def test_flex_forward_equals_dense(trainers, tiny_model_path, width, longest):
    """Rows of 32 (several sequences in less than one 128-token block), 128 (one block) and 200 tokens (a second,
    partial block: whole blocks masked out and skipped) hold two tasks' prompts, each with 3 completions."""
    from marlaas_hpc.trainer.packing import pack

    dense, flex = trainers["dense"], trainers["flex"]
    batch = pack(_trajectories(width, prompts=6, samples=3, longest=longest), width, dense.pad_id)
    assert batch.ids.shape[1] == width and len(set(batch.tasks)) == 2
    assert int(batch.prompt_of.max()) >= 1, "a row holds several prompts"
    assert any(len(batch.own[r][(batch.prompt_of[r] == p) & (batch.own[r] >= 0)].unique()) > 1
               for r in range(len(batch.tasks)) for p in range(int(batch.prompt_of[r].max()) + 1)), \
        "a prompt occurrence is shared by several completions"
    assert bool((batch.own == PADDING).any()), "rows end in padding"
    dense_out, dense_logp = _run(dense, batch)
    flex_out, flex_logp = _run(flex, batch)
    assert type(dense.model.decoder.layers[0].self_attention.core_attention).__name__ == "DotProductAttention"
    assert type(flex.model.decoder.layers[0].self_attention.core_attention).__name__ == "FlexCoreAttention"
    assert len(dense_out) == len(flex_out) == len(dense.model.decoder.layers)
    for layer, (a, b) in enumerate(zip(dense_out, flex_out)):
        assert a.shape == b.shape
        assert float((a - b).abs().max()) < TOL, (layer, float((a - b).abs().max()))
    assert float((dense_logp - flex_logp).abs().max()) < TOL * 10  # through the LM head: logits of ~10


def test_flex_path_builds_no_dense_mask(trainers, monkeypatch):
    """On the flex path the trainer packs rows at least one FlexAttention block wide and never builds the
    [rows, 1, s, s] mask; the packed batch carries segment ids only."""
    from torch.nn.attention.flex_attention import BlockMask

    from marlaas_hpc.trainer import attention

    flex = trainers["flex"]
    items = _trajectories(7, prompts=3, samples=2, longest=6)
    before = flex.logprobs("ka", [traj for task, traj in items if task == "ka"])

    def refuse(*args):
        raise AssertionError("dense mask built on the flex path")

    monkeypatch.setattr(attention, "dense_mask", refuse)
    batch = flex._pack(items)
    assert batch.ids.shape[1] >= attention.FLEX_BLOCK and not hasattr(batch, "attention_mask")
    assert isinstance(flex.attention.mask(batch.prompt_of, batch.own), BlockMask)
    assert flex.logprobs("ka", [traj for task, traj in items if task == "ka"]) == before
    assert trainers["dense"]._pack(items).ids.shape[1] < attention.FLEX_BLOCK  # the CPU twin's rows as before


def test_flex_training_is_refused_on_cpu(trainers):
    items = _trajectories(8, prompts=1, samples=2, longest=4)
    with pytest.raises(RuntimeError, match="CUDA only"):
        trainers["flex"].train_steps({"ka": [traj for task, traj in items if task == "ka"]})


def test_attention_settings_are_validated(tiny_model_path):
    from marlaas_hpc.config import TrainerSettings
    from marlaas_hpc.trainer.trainer import TrainerConfig

    assert resolve_attention("auto", torch.device("cpu")) == "dense"
    assert resolve_attention("auto", torch.device("cuda", 0)) == "flex"
    assert resolve_attention("dense", torch.device("cuda", 0)) == "dense"
    with pytest.raises(SpecError) as info:
        TrainerConfig(model_path=str(tiny_model_path), attention="sdpa").validate()
    assert info.value.field == "attention"
    assert TrainerSettings(attention="flex").validate().attention == "flex"
    with pytest.raises(SpecError) as info:
        TrainerSettings(attention="flash").validate()
    assert info.value.field == "trainer.attention"


def test_compiled_flex_over_30_micro_batches_equals_dense(trainers):
    """The flex trainer with its kernel compiled (dynamo's aot_eager backend on CPU: the graphs and guards inductor
    gets on CUDA) over 30 varied micro-batches (tools/flex_compiles.py's: 1 to ~10 rows, widths changing every
    step, one-block single rows among them): a few graphs, no call falls back, logprobs equal the dense path's."""
    import sys
    from pathlib import Path

    from marlaas_hpc.trainer.attention import FlexKernel

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    from flex_compiles import dynamo_enabled, micro_batches

    dense, flex = trainers["dense"], trainers["flex"]
    torch._dynamo.reset()
    try:
        with dynamo_enabled():
            flex.attention.kernel = kernel = FlexKernel("aot_eager")
            _compare_logprobs(dense, flex, micro_batches(30, seed=5, longest=200))  # positions < 256
    finally:
        flex.attention.kernel = None
    print(f"flex kernel over 30 micro-batches: {kernel.stats()}")
    assert kernel.fallbacks == 0 and 1 <= kernel.compiles <= torch._dynamo.config.recompile_limit // 2


def _compare_logprobs(dense, flex, batches) -> None:
    for seed, items in batches:
        trajectories = [traj for _, traj in items]
        for a, b in zip(dense.logprobs("ka", trajectories), flex.logprobs("ka", trajectories)):
            assert max(abs(x - y) for x, y in zip(a, b)) < TOL * 10
