"""A rollout rank's engine that fails is rebuilt in place (rollout/restart.py): the adapter versions it held and
the versions episodes pinned come back (from their dirs, or from the tensors held in memory), and every request in
flight is re-issued and finishes once.

The failure is vLLM's own: the engine core is shut down under the engine (what a dead engine core looks like to
the in-process client); the next step raises inside vLLM. The old engine is unreachable before the new one is
built (its weights and KV cache freed: vLLM's start checks the free memory). A CUDA error, which poisons the
process's CUDA context, ends the rank instead of a rebuild."""
from __future__ import annotations

import weakref

import pytest
import torch

from marlaas_hpc.rollout import AdapterRef, GenerationRequest, make_engine
from marlaas_hpc.rollout.restart import EngineFailed, RestartingEngine, poisons_cuda
from marlaas_hpc.trainer.peft_io import read_peft_adapter
from support.rollout import PROMPTS


@pytest.fixture(scope="module")
def factory(tiny_model_path):
    pytest.importorskip("vllm")
    from marlaas_hpc.model.cache import default_cache_dir
    from marlaas_hpc.rollout.vllm_engine import import_vllm

    work_dir = default_cache_dir() / "vllm-test-engine"
    # vLLM keeps an error it caught on import with every frame then on the stack (rollout/vllm_engine.py
    # import_vllm): imported here, no test's frame is kept
    import_vllm(work_dir)
    return lambda: make_engine("vllm", tiny_model_path, work_dir=work_dir, max_loras=4, max_lora_rank=8, seed=0)


def _requests(codec, tag):
    """Greedy requests (deterministic) on t1 v0 (superseded, pinned by an episode), t1 v1 and the base model."""
    return [GenerationRequest(f"{tag}{task}v{version}-{i}", task, version, codec.encode_prompt(text),
                              temperature=0.0, max_new_tokens=10)
            for i, text in enumerate(PROMPTS) for task, version in (("t1", 0), ("t1", 1), ("base", None))]


def _break(engine: RestartingEngine) -> None:
    engine.engine.engine.engine_core.shutdown()


@pytest.mark.vllm
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


@pytest.mark.vllm
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


def _weights(engine):
    """The model of a VllmEngine's in-process worker (what holds the weights on the device)."""
    return engine.llm.llm_engine.model_executor.driver_worker.worker.model_runner.model


@pytest.mark.vllm
def test_the_failed_engine_is_unreachable_when_the_new_one_is_built(factory, codec, caplog):
    """vLLM starts only if the free device memory covers gpu_memory_utilization: the failed engine's weights and KV
    cache must be gone first. So when the factory runs again, the old VllmEngine, its vLLM LLM and a weight tensor
    of its model are all unreachable (weak references dead): no exception traceback, frame or attribute holds
    them. (pytest's log capture keeps every record with its traceback, and vLLM logs a warning with one while it
    starts: the chat template warmup, impossible without a tokenizer. Its frames would hold the engine, so vLLM's
    warnings stay out of the capture here; no handler of a real run keeps records.)"""
    import logging

    caplog.set_level(logging.ERROR, logger="vllm")
    built, seen_at_rebuild = [], []

    def watched():
        if built:
            seen_at_rebuild.append({name: ref() is not None for name, ref in built[-1].items()})
        engine = factory()
        built.append({"engine": weakref.ref(engine), "llm": weakref.ref(engine.llm),
                      "weight": weakref.ref(next(_weights(engine).parameters()))})
        return engine

    engine = RestartingEngine(watched)
    try:
        engine.submit(_requests(codec, "x-")[2:3])
        _break(engine)
        assert engine.step() == [] and engine.restarts == 1
        assert seen_at_rebuild == [{"engine": False, "llm": False, "weight": False}]
        while engine.has_unfinished():
            engine.step()
    finally:
        engine.close()


@pytest.mark.vllm
def test_a_cuda_error_ends_the_rank_instead_of_a_rebuild(factory, codec):
    """An illegal memory access leaves the process's CUDA context unusable: a rebuild in it fails or computes
    garbage. The engine's step raises the error as torch raises it on a GPU (a failure this CPU cannot provoke);
    RestartingEngine raises instead of building another engine (the job stops and resumes from its checkpoints)."""
    builds = []

    def counted():
        builds.append(factory())
        return builds[-1]

    engine = RestartingEngine(counted)
    try:
        engine.submit(_requests(codec, "x-")[2:3])

        def illegal_access():
            raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered\nCUDA kernel errors "
                                         "might be asynchronously reported at some other API call")

        engine.engine.step = illegal_access
        with pytest.raises(EngineFailed, match="illegal memory access"):
            engine.step()
        assert len(builds) == 1, "no engine is built in a process whose CUDA context is poisoned"
    finally:
        engine.close()


@pytest.mark.parametrize("error, poisoned", [
    (torch.AcceleratorError("CUDA error: an illegal memory access was encountered"), True),
    (RuntimeError("CUDA error: device-side assert triggered"), True),
    (RuntimeError("CUDA error: unspecified launch failure"), True),
    (RuntimeError("CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasGemmEx( handle, opa, ...)`"), True),
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), False),
    (RuntimeError("CUDA error: out of memory"), False),
    (AssertionError("pipeline model parallel group is not initialized"), False),
    (RuntimeError("Engine core died"), False),
])
def test_which_errors_poison_the_cuda_context(error, poisoned):
    assert poisons_cuda(error) is poisoned
    wrapped = RuntimeError("EngineCore encountered an issue")
    wrapped.__cause__ = error  # vLLM re-raises a worker's error from it
    assert poisons_cuda(wrapped) is poisoned
