"""Expert parallelism in the trainer (trainer/experts_parallel.py, `TrainerConfig.expert_parallel`): at DP=2, TP=1,
EP=2 (each rank holding half of every MoE layer's experts, tokens sent to them with megatron's all-to-all
dispatcher) equals EP=1 -- logprobs, losses, LoRA gradients and weights after two fused steps of an attention-only
and a default-target (experts included) task and a step of one row (the other replica runs a zero-weight
micro-batch), the exported adapter -- and the logprobs equal transformers'. On the
random `qwen3-30b-a3b-mini` and the checkpoint transformers writes (tests/support/moe_scenarios.py); one pair of
spawned gloo ranks runs both checkpoints at EP=1 then EP=2 (tests/support/ep_scenarios.py)."""
from __future__ import annotations

import pytest
import torch

from support.checks import max_diff
from support.ep_scenarios import ep_per_checkpoint
from support.local_group import checkpoint_records, run_local
from support.moe_scenarios import HF_VOCAB, STEPS, hf_model, moe_batch, moe_probe, write_hf_moe_checkpoint

EP_TOL = 1e-5
"""EP=2 vs EP=1 (fp32): logprobs, losses, gradients."""
LOGIT_TOL = 1e-4
"""The trainer vs transformers (fp32)."""
CHECKPOINTS = ["random:qwen3-30b-a3b-mini", "hf"]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, tuple]:
    """Per checkpoint: (path, probe rows, batch with transformers' routes)."""
    from marlaas_hpc.model.random_checkpoints import ensure_random_checkpoint

    root = tmp_path_factory.mktemp("ep_checkpoints")
    paths = {"random:qwen3-30b-a3b-mini": ensure_random_checkpoint("qwen3-30b-a3b-mini"),
             "hf": write_hf_moe_checkpoint(root / "hf", HF_VOCAB)}
    out = {}
    for checkpoint, path in paths.items():
        hf_base = hf_model(path)
        out[checkpoint] = (path, moe_probe(hf_base.config.vocab_size), moe_batch(hf_base)[0])
    return out


@pytest.fixture(scope="module")
def all_runs(inputs, tmp_path_factory) -> dict[str, dict[int, list]]:
    """{checkpoint: {0: [{ep: record} of each rank]}} (the `checkpoint_records` layout, one group)."""
    out_dir = tmp_path_factory.mktemp("ep_exports")
    runs = {c: (str(path), probe, batch, str(out_dir / c.replace(":", "_")))
            for c, (path, probe, batch) in inputs.items()}
    by_rank = run_local(ep_per_checkpoint, 2, runs, timeout=600)
    return {c: {0: [records[c] for records in by_rank]} for c in runs}


@pytest.fixture(scope="module", params=CHECKPOINTS)
def checkpoint(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def ranks(checkpoint, all_runs) -> list[dict]:
    return checkpoint_records(all_runs, checkpoint, "EP scenario")[0]


def test_ep2_holds_half_of_the_experts_on_each_rank(ranks, inputs, checkpoint):
    experts = hf_model(inputs[checkpoint][0]).config.num_experts
    for record in ranks:
        assert set(record[1]["local_experts"]) == {experts}
        assert set(record[2]["local_experts"]) == {experts // 2}


def test_ep2_logprobs_equal_ep1_and_transformers(ranks, inputs, checkpoint):
    from marlaas_hpc.trainer.objectives import token_logprobs

    hf_base = hf_model(inputs[checkpoint][0])
    _, probe, batch = inputs[checkpoint]
    with torch.no_grad():
        reference = hf_base(input_ids=torch.tensor(probe)).logits
    for record in ranks:
        one, two = record[1], record[2]
        logits_diff = float((two["base_logits"] - reference).abs().max())
        ep_diff = max(abs(a - b) for r1, r2 in zip(one["base_logprobs"], two["base_logprobs"]) for a, b in zip(r1, r2))
        replay_diff = max(abs(a - b) for r1, r2 in zip(one["replay_logprobs"], two["replay_logprobs"])
                          for a, b in zip(r1, r2))
        hf_diff = 0.0
        for traj, got in zip(batch, two["base_logprobs"]):
            with torch.no_grad():
                logits = hf_base(input_ids=torch.tensor([traj.prompt_ids + traj.completion_ids])).logits[0]
            want = token_logprobs(logits[len(traj.prompt_ids) - 1:-1], torch.tensor(traj.completion_ids), 1.0)
            hf_diff = max(hf_diff, float((torch.tensor(got) - want).abs().max()))
        print(f"{checkpoint}: EP=2 vs EP=1 logprobs {ep_diff:.1e} (replayed {replay_diff:.1e}); vs transformers "
              f"logits {logits_diff:.1e}, logprobs {hf_diff:.1e}")
        assert ep_diff <= EP_TOL and replay_diff <= EP_TOL
        assert logits_diff <= LOGIT_TOL and hf_diff <= LOGIT_TOL


def test_ep2_equals_ep1_losses_grads_weights_and_export(ranks, checkpoint):
    from safetensors.torch import load_file

    worst = {"grads": 0.0, "weights": 0.0, "export": 0.0, "loss": 0.0}
    for record in ranks:
        one, two = record[1], record[2]
        assert len(one["steps"]) == len(two["steps"]) == STEPS + 1
        for step_one, step_two in zip(one["steps"], two["steps"]):
            for task_id, s1 in step_one.items():
                s2 = step_two[task_id]
                for key in ("loss", "clip_frac", "ratio_mean", "grad_norm", "tokens", "kl"):
                    a, b = s1["metrics"][key], s2["metrics"][key]
                    assert abs(a - b) <= EP_TOL * max(1.0, abs(a)), (task_id, key, a, b)
                worst["loss"] = max(worst["loss"], abs(s1["metrics"]["loss"] - s2["metrics"]["loss"]))
                assert s1["grads"].keys() == s2["grads"].keys()
                worst["grads"] = max(worst["grads"], max_diff(s1["grads"], s2["grads"]))
        for task_id in one["tensors"]:
            assert one["tensors"][task_id].keys() == two["tensors"][task_id].keys()
            worst["weights"] = max(worst["weights"], max_diff(one["tensors"][task_id], two["tensors"][task_id]))
            exported = [load_file(f"{r['export'][task_id]}/adapter_model.safetensors") for r in (one, two)]
            assert exported[0].keys() == exported[1].keys()
            worst["export"] = max(worst["export"], max_diff(*exported))
        assert max(abs(a - b) for r1, r2 in zip(one["logprobs_e"], two["logprobs_e"]) for a, b in zip(r1, r2)) <= EP_TOL
        assert float((two["reloaded_logits"] - two["logits_e"]).abs().max()) <= EP_TOL
    print(f"{checkpoint}: EP=2 vs EP=1 max diffs {worst}")
    expert_grads = [v for k, v in ranks[0][2]["steps"][1]["e"]["grads"].items() if ".mlp.experts." in k]
    assert expert_grads and all(v.abs().max() > 0 for v in expert_grads[:4]), "the expert gradients are not trivial"
    assert worst["grads"] <= EP_TOL
    # Adam amplifies 1e-7 gradient differences on near-zero entries (as in test_trainer_dp)
    assert worst["weights"] <= 1e-3 and worst["export"] <= 1e-3


def test_expert_parallel_refusals_name_the_field(inputs, tiny_model_path):
    from marlaas_hpc.tasks.spec import SpecError
    from marlaas_hpc.trainer.trainer import TrainerConfig

    moe = str(inputs["hf"][0])
    refused = {"3 of 8 experts": dict(model_path=moe, data_parallel=3, expert_parallel=3),
               "TP=2": dict(model_path=moe, tensor_parallel=2, data_parallel=2, expert_parallel=2),
               "DP=1": dict(model_path=moe, data_parallel=1, expert_parallel=2),
               "dense model": dict(model_path=str(tiny_model_path), data_parallel=2, expert_parallel=2),
               "zero": dict(model_path=moe, expert_parallel=0)}
    for case, fields in refused.items():
        with pytest.raises(SpecError) as error:
            TrainerConfig(**fields).validate()
        assert "expert_parallel" in str(error.value), case
    TrainerConfig(model_path=moe, data_parallel=4, expert_parallel=2).validate()
