"""A rollout rank's engine that fails is rebuilt in place (rollout/restart.py): the adapter versions it held and
the versions episodes pinned come back (from their dirs, or from the tensors held in memory), and every request in
flight is re-issued and finishes once.

The failure is vLLM's own: the engine core is shut down under the engine (what a dead engine core looks like to
the in-process client); the next step raises inside vLLM."""
from __future__ import annotations

import pytest

from marlaas_hpc.rollout import AdapterRef, GenerationRequest, make_engine
from marlaas_hpc.rollout.restart import EngineFailed, RestartingEngine
from marlaas_hpc.trainer.peft_io import read_peft_adapter
from rollout_helpers import PROMPTS

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def factory(tiny_model_path):
    pytest.importorskip("vllm")
    from marlaas_hpc.model.cache import default_cache_dir

    return lambda: make_engine("vllm", tiny_model_path, work_dir=default_cache_dir() / "vllm-test-engine",
                               max_loras=4, max_lora_rank=8, seed=0)


def _requests(codec, tag):
    """Greedy requests (deterministic) on t1 v0 (superseded, pinned by an episode), t1 v1 and the base model."""
    return [GenerationRequest(f"{tag}{task}v{version}-{i}", task, version, codec.encode_prompt(text),
                              temperature=0.0, max_new_tokens=10)
            for i, text in enumerate(PROMPTS) for task, version in (("t1", 0), ("t1", 1), ("base", None))]


def _break(engine: RestartingEngine) -> None:
    engine.engine.engine.engine_core.shutdown()


def test_engine_error_restarts_the_engine_and_reissues_its_requests(factory, adapters, codec):
    restarts = []
    engine = RestartingEngine(factory, on_restart=lambda cause, n, requests: restarts.append((cause, n, requests)))
    try:
        engine.add_adapter(AdapterRef("t1", 0, str(adapters["t1"])))
        engine.pin("t1", 0)  # a multi-turn episode holds v0 between its turns
        lora, tensors = read_peft_adapter(adapters["t2"])  # v1 from memory, as a rollout rank's deltas
        engine.add_adapter(AdapterRef("t1", 1, tensors=tensors, lora=lora))
        expected = {g.request_id.split("-", 1)[1]: g for g in engine.generate(_requests(codec, "before-"))}
        engine.submit(_requests(codec, "after-"))
        done = engine.step()
        in_flight = len(_requests(codec, "")) - len(done)
        _break(engine)
        while engine.has_unfinished():
            done += engine.step()
        assert [(n, requests) for _, n, requests in restarts] == [(1, in_flight)] and in_flight > 0
        assert "pipeline model parallel group is not initialized" in restarts[0][0], "vLLM's own error"
        assert sorted(g.request_id for g in done) == sorted(r.request_id for r in _requests(codec, "after-")), \
            "every request finished exactly once"
        for gen in done:
            ref = expected[gen.request_id.split("-", 1)[1]]
            assert (gen.adapter_version, gen.completion_ids) == (ref.adapter_version, ref.completion_ids)
        assert engine.versions.pinned("t1") == {0: 1}, "the episode's pin came back"
        engine.unpin("t1", 0)
        assert engine.versions.live("t1") == [1], "v0 retires once its episode ends, as before the restart"
    finally:
        engine.close()


def test_an_engine_that_keeps_failing_gives_up(factory, codec):
    engine = RestartingEngine(factory, max_restarts=1)
    try:
        engine.submit(_requests(codec, "x-")[2:3])
        _break(engine)
        engine.step()  # restart 1
        _break(engine)
        with pytest.raises(EngineFailed, match="failed 2 times in a row"):
            engine.step()
    finally:
        engine.close()
