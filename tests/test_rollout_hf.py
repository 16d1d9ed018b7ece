"""transformers + PEFT rollout engine: left padding, mixed-adapter batches, behaviour logprobs, version pinning."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from marlaas_hpc.rollout import AdapterRef, AdapterVersions, GenerationRequest, make_engine
from support.rollout import (PROMPTS, check_mixed_batch_rows_equal_single_runs,
                             check_sampled_logprobs_equal_teacher_forcing, mixed_requests)


def test_hf_greedy_equals_unbatched_reference(hf_engine, codec, adapters, peft_reference):
    gens = hf_engine.generate(mixed_requests(codec, 0.0))
    for gen in gens:
        path = adapters.get(gen.task_id) if gen.adapter_version is not None else None
        assert gen.completion_ids == peft_reference.greedy(path, gen.prompt_ids, 12), gen.request_id
        assert len(gen.logprobs) == len(gen.completion_ids)
        ref = peft_reference.logprobs(path, gen.prompt_ids, gen.completion_ids, 0.0)
        np.testing.assert_allclose(gen.logprobs, ref, atol=1e-4)
        assert gen.finish_reason == ("stop" if gen.completion_ids[-1] == codec.eos_id else "length")
    assert any(g.finish_reason == "length" for g in gens)


def test_hf_sampled_logprobs_equal_teacher_forcing(hf_engine, codec, adapters, peft_reference):
    check_sampled_logprobs_equal_teacher_forcing(hf_engine, codec, adapters, peft_reference)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_hf_mixed_batch_rows_equal_single_runs(hf_engine, codec, temperature):
    check_mixed_batch_rows_equal_single_runs(hf_engine, codec, temperature)


def test_hf_base_only_engine_and_chunked_batches(tiny_model_path, adapters, hf_engine, codec, peft_reference):
    engine = make_engine("hf", tiny_model_path, max_batch_size=4)
    [base] = engine.generate([GenerationRequest("b", "base", None, codec.encode_prompt(PROMPTS[0]), 0.0, 12)])
    assert base.completion_ids == peft_reference.greedy(None, base.prompt_ids, 12)  # before any adapter exists
    for task, path in adapters.items():
        engine.add_adapter(AdapterRef(task, 0, str(path)))
    chunked = engine.generate(mixed_requests(codec, 0.7, tag="chunk-"))  # 15 rows in batches of <= 4
    whole = hf_engine.generate(mixed_requests(codec, 0.7, tag="whole-"))
    assert [g.completion_ids for g in chunked] == [g.completion_ids for g in whole]


def test_hf_per_row_limits_and_seeds(hf_engine, codec):
    prompt = codec.encode_prompt(PROMPTS[0])
    reqs = [GenerationRequest(f"lim-{n}", "t1", 0, prompt, temperature=1.0, max_new_tokens=n, seed=7)
            for n in (1, 3, 9)]
    gens = hf_engine.generate(reqs)
    for gen, req in zip(gens, reqs):
        assert len(gen.completion_ids) <= req.max_new_tokens
    # same seed, same adapter, same prompt: each shorter completion is a prefix of the longer one
    assert gens[2].completion_ids[:len(gens[1].completion_ids)] == gens[1].completion_ids


def test_hf_version_pinning_and_retirement(tiny_model_path, adapters, codec):
    engine = make_engine("hf", tiny_model_path)
    engine.add_adapter(AdapterRef("pin", 0, str(adapters["t1"])))
    prompt = codec.encode_prompt(PROMPTS[1])
    [alone] = engine.generate([GenerationRequest("v0-alone", "pin", 0, prompt, temperature=0.0, max_new_tokens=20)])
    engine.submit([GenerationRequest("v0-pinned", "pin", 0, prompt, temperature=0.0, max_new_tokens=20)])
    engine.add_adapter(AdapterRef("pin", 1, str(adapters["t2"])))
    assert engine.loaded_adapters() == {("pin", 0), ("pin", 1)}, "v0 must stay while a request uses it"
    [gen] = engine.step()
    assert gen.adapter_version == 0
    assert (gen.completion_ids, gen.logprobs) == (alone.completion_ids, alone.logprobs)
    assert engine.loaded_adapters() == {("pin", 1)} and engine.versions.live("pin") == [1]
    assert engine.pop_retired() == [AdapterRef("pin", 0, str(adapters["t1"]))] and engine.pop_retired() == []
    with pytest.raises(KeyError, match="pin v0"):
        engine.submit([GenerationRequest("late", "pin", 0, prompt)])


def test_hf_unknown_version_raises_and_queues_nothing(hf_engine, codec):
    prompt = codec.encode_prompt("1")
    good = GenerationRequest("ok", "t1", 0, prompt)
    with pytest.raises(KeyError, match=r"t1 v5 is not registered .*live versions of 't1': \[0\]"):
        hf_engine.submit([good, GenerationRequest("bad", "t1", 5, prompt)])
    with pytest.raises(KeyError, match="nosuch v0"):
        hf_engine.submit([GenerationRequest("bad2", "nosuch", 0, prompt)])
    assert not hf_engine.has_unfinished() and hf_engine.versions.in_flight[("t1", 0)] == 0


def test_adapter_versions_bookkeeping():
    v = AdapterVersions()
    assert v.add(AdapterRef("a", 0, "/p0")) == []
    i0 = v.acquire("a", 0)
    assert v.add(AdapterRef("a", 1, "/p1")) == []  # v0 still in flight
    assert v.check_new(AdapterRef("a", 2, "/p2")) == v.int_id[("a", 1)] + 1
    with pytest.raises(ValueError, match="already registered"):
        v.check_new(AdapterRef("a", 1, "/p1"))
    assert v.release("a", 0) == [("a", 0)] and v.live("a") == [1] and i0 not in v.int_id.values()
    with pytest.raises(ValueError, match="older"):
        v.add(AdapterRef("a", 0, "/p0"))  # retired, and older than v1
    with pytest.raises(KeyError):
        v.acquire("a", 0)


def test_make_engine_rejects_unknown_kind(tiny_model_path):
    with pytest.raises(ValueError, match="unknown rollout engine kind"):
        make_engine("sglang", tiny_model_path)


def test_adapter_ref_is_a_path_or_tensors_with_their_spec():
    with pytest.raises(ValueError, match="exactly one of a path or tensors"):
        AdapterRef("a", 0)
    with pytest.raises(ValueError, match="exactly one of a path or tensors"):
        AdapterRef("a", 0, "/p", tensors={})
    with pytest.raises(ValueError, match="need their LoraSpec"):
        AdapterRef("a", 0, tensors={})


def test_hf_in_memory_adapter_equals_its_directory_and_bad_tensors_are_refused(hf_engine, adapters, codec):
    """The tensors a rollout rank receives load without a directory and sample exactly like the same adapter
    loaded from its PEFT dir; tensors that do not fit the model are refused, the engine serving on."""
    from marlaas_hpc.trainer.peft_io import read_peft_adapter

    lora, tensors = read_peft_adapter(adapters["t2"])
    hf_engine.add_adapter(AdapterRef("mem", 0, tensors=tensors, lora=lora))
    reqs = [GenerationRequest(f"{task}-{i}", task, 0, codec.encode_prompt(text), temperature=0.7,
                              max_new_tokens=10, seed=11 + i)
            for i, text in enumerate(PROMPTS) for task in ("t2", "mem")]
    gens = hf_engine.generate(reqs)
    for disk, memory in zip(gens[::2], gens[1::2]):
        assert (memory.completion_ids, memory.logprobs) == (disk.completion_ids, disk.logprobs)
    bad = {k.replace("layers.0.", "layers.99."): v for k, v in tensors.items()}  # the tiny model has 4 layers
    with pytest.raises(ValueError, match="bad v0: tensors missing .*unexpected"):
        hf_engine.add_adapter(AdapterRef("bad", 0, tensors=bad, lora=lora))
    assert "bad" not in hf_engine.versions.latest
    [again] = hf_engine.generate([GenerationRequest("again", "mem", 0, reqs[1].prompt_ids, temperature=0.7,
                                                    max_new_tokens=10, seed=11)])
    assert again.completion_ids == gens[1].completion_ids, "the refused load left 'mem' as it was"
    np.testing.assert_allclose(again.logprobs, gens[1].logprobs, atol=1e-5)  # alone vs in a padded batch


def test_row_sampler_draws_from_softmax_over_temperature():
    """Each row's token frequencies follow softmax(logits / T) (a bias in the inverse-CDF draw moves them),
    T = 0 rows take the argmax, a row with NaN logits still gets a token, and a seeded row draws the same
    tokens whatever rows share its batch."""
    import torch

    from marlaas_hpc.rollout.hf_engine import _RowSampler

    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -30.0], [0.0, 3.0, 0.0, 0.0, 0.0], [float("nan")] * 5])
    temps, draws = [0.7, 0.0, 1.0], 4000
    generators = [torch.Generator().manual_seed(i) for i in range(3)]
    counts = torch.zeros(3, 5)
    for _ in range(draws):
        out = _RowSampler(temps, generators)(torch.empty(3, 1), logits)
        assert torch.isfinite(out).sum(dim=1).tolist() == [1, 1, 1]
        counts += torch.isfinite(out).float()
    expected = torch.softmax(logits[0] / 0.7, dim=-1)
    assert (counts[0] / draws - expected).abs().max() < 0.03
    assert counts[1].tolist() == [0, draws, 0, 0, 0]

    def tokens(rows):
        gens = {seed: torch.Generator().manual_seed(seed) for seed in rows}
        batch = torch.tensor([[float(seed % 3), 1.0, 0.5, 0.0, 2.0] for seed in rows])
        picks = [_RowSampler([1.0] * len(rows), list(gens.values()))(None, batch).argmax(dim=1) for _ in range(20)]
        return torch.stack(picks)[:, list(rows).index(7)].tolist()

    assert tokens([7]) == tokens([3, 7, 11])


def test_hf_engine_ignores_the_checkpoints_sampling_defaults_quietly(capfd):
    """A Qwen3 checkpoint's generation_config.json asks for temperature 0.6, top_k 20, top_p 0.95: the engine
    samples by its own rule (_RowSampler), and transformers warned on every batch that these flags were ignored."""
    from marlaas_hpc.model.random_checkpoints import ensure_random_checkpoint
    from marlaas_hpc.rollout import GenerationRequest, make_engine

    path = ensure_random_checkpoint("qwen3-0.6b-mini")
    assert '"temperature": 0.6' in (path / "generation_config.json").read_text()
    capfd.readouterr()
    engine = make_engine("hf", path, device="cpu")
    gens = engine.generate([GenerationRequest(f"r{i}", "base", None, [10, 11, 12], temp, 4, seed=i)
                            for i, temp in enumerate((1.0, 0.0))])
    assert [len(g.completion_ids) for g in gens] == [4, 4]
    err = capfd.readouterr().err
    assert "generation flags are not valid" not in err, err


def test_hf_sampled_rows_decode_bit_identically_whether_or_not_greedy_rows_share_the_step(hf_engine, codec):
    """Evals (greedy rows) reach a rollout rank at timing-dependent moments; a step decodes them apart from the
    sampled (training) rows, so a training group's logprobs, and a job's adapters after them, do not depend on
    whether an eval arrived in the same step (an fp32 row's logprobs change in their last bits with the batch's
    make-up: another padded width, other matmul shapes)."""
    sampled = [GenerationRequest(f"alone-{i}", "t1", 0, codec.encode_prompt(text), 1.0, 8, seed=i)
               for i, text in enumerate(PROMPTS[:3])]
    alone = hf_engine.generate(sampled)
    evals = [GenerationRequest(f"eval-{i}", "base", None, codec.encode_prompt(text * 3), 0.0, 8)
             for i, text in enumerate(PROMPTS)]
    together = hf_engine.generate([dataclasses.replace(r, request_id="with-" + r.request_id) for r in sampled]
                                  + evals)
    together = {g.request_id: g for g in together}
    for gen in alone:
        mixed = together["with-" + gen.request_id]
        assert (mixed.completion_ids, mixed.logprobs) == (gen.completion_ids, gen.logprobs), gen.request_id
