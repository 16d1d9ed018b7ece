"""Routing replay's rollout side and config (`algo.routing_replay`): the engines record each fed position's experts
in the trainer's layout, a multi-turn episode keeps each position's first record, and the field is refused where
there is nothing to replay. The trainer's side: tests/test_trainer_moe.py (replay), tests/test_moe_mpi.py (a job)."""
from __future__ import annotations

import numpy
import pytest
import torch

from support.moe_scenarios import ranked_routes


@pytest.fixture(scope="module")
def moe_path():
    from marlaas_hpc.model.random_checkpoints import ensure_random_checkpoint

    return ensure_random_checkpoint("qwen3-30b-a3b-mini")


def _requests(prompts, routes=True, tokens=5):
    from marlaas_hpc.rollout.base import GenerationRequest

    return [GenerationRequest(request_id=f"r{i}", task_id="t", adapter_version=None, prompt_ids=prompt,
                              temperature=1.0, max_new_tokens=tokens, seed=i, ignore_stop=True, return_routes=routes)
            for i, prompt in enumerate(prompts)]


def test_the_hf_engine_records_the_experts_transformers_routes_every_fed_position_to(moe_path):
    """Rows of different lengths in one left-padded batch: each row's routes are [prompt + completion - 1, MoE
    layers, k] int16, and equal the experts transformers chooses for that sequence alone (prompt and sampled
    tokens); a request that does not ask gets none."""
    from marlaas_hpc.rollout.hf_engine import HfEngine

    engine = HfEngine(moe_path, device="cpu")
    prompts = [[11, 12, 13, 14, 15, 16, 17], [21, 22, 23]]
    engine.submit(_requests(prompts))
    gens = {gen.request_id: gen for gen in engine.step()}
    for gen in gens.values():
        ids = gen.prompt_ids + gen.completion_ids
        assert gen.routes.dtype == numpy.int16 and gen.routes.shape[0] == len(ids) - 1
        want = ranked_routes(engine.base, ids, 0)
        assert numpy.array_equal(numpy.sort(gen.routes, axis=-1), numpy.sort(want, axis=-1)), gen.request_id
    engine.submit(_requests([[41, 42, 43]], routes=False))
    (plain,) = engine.step()
    assert plain.routes is None


def test_a_multi_turn_episode_keeps_each_positions_first_record():
    from marlaas_hpc.runtime.env_rank import _Episode

    episode = _Episode(env=None)
    first = numpy.full((6, 2, 2), 1, dtype=numpy.int16)
    second = numpy.full((10, 2, 2), 2, dtype=numpy.int16)  # the next turn fed the whole context again
    episode.add_routes(first)
    episode.add_routes(second)
    assert episode.routes.shape == (10, 2, 2)
    assert (episode.routes[:6] == 1).all() and (episode.routes[6:] == 2).all()


def test_routes_of_the_wrong_length_are_refused_by_the_trajectory():
    from marlaas_hpc.trajectory import Trajectory

    traj = Trajectory("t", "g", [1, 2, 3], [4, 5], [0.0, 0.0], 0, routes=numpy.zeros((4, 2, 2), dtype=numpy.int16))
    traj.check()
    traj.routes = numpy.zeros((2, 2, 2), dtype=numpy.int16)
    with pytest.raises(ValueError, match="routes of shape"):
        traj.check()


def test_routing_replay_on_a_dense_model_is_refused_naming_the_field():
    from marlaas_hpc.config_loader import SpecError
    from marlaas_hpc.tasks.spec import AlgoSpec

    with pytest.raises(SpecError, match="algo.routing_replay"):
        AlgoSpec(routing_replay="yes").validate()
    from marlaas_hpc.model.random_checkpoints import ensure_random_checkpoint
    from support.configs import one_task_job

    dense = ensure_random_checkpoint("qwen3-0.6b-mini")
    job = one_task_job(model=str(dense), engine="hf", tasks=[{"task_id": "t", "algo": {"routing_replay": True}}])
    with pytest.raises(SpecError, match=r"tasks\[0\]\.algo\.routing_replay.*dense"):
        job.check_models()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_vllm_returns_the_routes_of_every_fed_position_in_the_trainers_layout(moe_path, tmp_path):
    """vLLM 0.32's `enable_return_routed_experts` (VllmEngine(return_routes=True)): [prompt + completion - 1, MoE
    layers, k] int16 per sample, the prompt's experts those transformers chooses (bf16 vLLM against fp32
    transformers: most positions)."""
    from marlaas_hpc.rollout import make_engine

    engine = make_engine("vllm", moe_path, work_dir=tmp_path, return_routes=True, warmup=False)
    engine.submit(_requests([[11, 12, 13, 14, 15, 16, 17]]))
    done = []
    while engine.has_unfinished():
        done += engine.step()
    (gen,) = done
    ids = gen.prompt_ids + gen.completion_ids
    assert gen.routes.dtype == numpy.int16 and gen.routes.shape[0] == len(ids) - 1
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(str(moe_path), dtype=torch.float32).eval()
    want = ranked_routes(reference, ids, 0)
    same = (numpy.sort(gen.routes, axis=-1) == numpy.sort(want, axis=-1)).all(axis=-1)
    assert same.mean() > 0.9, same.mean()
