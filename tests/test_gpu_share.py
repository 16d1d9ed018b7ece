"""Issue 36 item 8: a GPU shared by an engine and trainer ranks after start-up (launch/gpu_share.py). Real processes
take real node-local locks: an engine's rebuild waits for the training step under way, a step waits while an engine
changes, back-to-back steps do not starve an engine; a rebuild reuses the KV-cache size of the first start and asks
only for free memory; the trainer's allocator is capped at what vLLM's share leaves."""
from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

import pytest

from marlaas_hpc.launch.devices import DeviceBinding
from marlaas_hpc.launch.gpu_share import (GpuTurns, gpu_turns, rebuild_engine_kwargs, trainer_memory_fraction,
                                          turns_dir)
from marlaas_hpc.rollout.restart import RestartingEngine
from marlaas_hpc.runtime.engines import TurnTakingBuild

SPAWN = multiprocessing.get_context("spawn")


def _trainer_steps(lock_dir: str, gpu: str, steps: int, step_s: float, started, log) -> None:
    """A trainer rank's loop: `steps` back-to-back steps of `step_s` each, every step in its turn."""
    turns = GpuTurns(Path(lock_dir), (gpu,))
    for step in range(steps):
        with turns.training_step():
            if step == 0:
                started.set()
            log.put(("step", step, time.monotonic(), "start"))
            time.sleep(step_s)
            log.put(("step", step, time.monotonic(), "end"))


def _engine_change(lock_dir: str, gpu: str, hold_s: float, held, log) -> None:
    turns = GpuTurns(Path(lock_dir), (gpu,))
    with turns.engine_change("a test engine's rebuild"):
        held.set()
        log.put(("engine", 0, time.monotonic(), "start"))
        time.sleep(hold_s)
        log.put(("engine", 0, time.monotonic(), "end"))


def _drain(log) -> list[tuple]:
    entries = []
    while not log.empty():
        entries.append(log.get())
    return sorted(entries, key=lambda entry: entry[2])


def test_an_engine_rebuild_waits_for_the_steps_under_way_and_steps_do_not_starve_it(tmp_path):
    """Two trainer processes on the GPU, their steps overlapping by half a step: the shared lock is never free, so
    without the engine's announced intent it would wait for all their steps."""
    log, started = SPAWN.Queue(), [SPAWN.Event(), SPAWN.Event()]
    trainers = [SPAWN.Process(target=_trainer_steps, args=(str(tmp_path), "0", 10, 0.4, started[i], log))
                for i in range(2)]
    trainers[0].start()
    assert started[0].wait(60), "the trainer never took its turn"
    time.sleep(0.2)
    trainers[1].start()
    assert started[1].wait(60)
    built, asked = [], time.monotonic()
    engine = RestartingEngine(TurnTakingBuild(lambda **extra: built.append((time.monotonic(), extra)) or object(),
                                              GpuTurns(tmp_path, ("0",)), utilization=0.5))
    for trainer in trainers:
        trainer.join(60)
    entries = _drain(log)
    when, extra = built[0]
    assert engine is not None and extra == {}
    starts = sum(1 for e in entries if e[2] < when and e[3] == "start")
    assert starts == sum(1 for e in entries if e[2] < when and e[3] == "end"), "the engine started while a step ran"
    ends = sum(1 for e in entries if asked < e[2] < when and e[3] == "end")
    assert ends <= 3, f"the engine waited for {ends} steps: back-to-back steps starved it"
    assert sum(1 for e in entries if e[3] == "end") == 20


def test_a_training_step_waits_while_the_engine_changes_and_a_gpu_of_its_own_does_not(tmp_path):
    log, held = SPAWN.Queue(), SPAWN.Event()
    engine = SPAWN.Process(target=_engine_change, args=(str(tmp_path), "3", 1.5, held, log))
    engine.start()
    assert held.wait(60)
    other = GpuTurns(tmp_path, ("2",))  # another GPU of the node: no wait
    start = time.monotonic()
    with other.training_step():
        assert time.monotonic() - start < 0.5
    waited: list[str] = []
    turns = GpuTurns(tmp_path, ("3",), log=waited.append)
    with turns.training_step():
        stepped = time.monotonic()
    engine.join(60)
    (_, _, _, _), (_, _, ended, _) = _drain(log)
    assert stepped >= ended, "the step ran while the engine was changing"
    assert turns.waited_s >= 1.0 and waited and waited[0].startswith("[gpu] the training step waited"), waited


def test_turns_are_reentrant_within_a_rank_and_ordered_over_several_gpus(tmp_path):
    turns = GpuTurns(tmp_path, ("1", "0"))
    assert turns.gpus == ("0", "1")
    with turns.engine_change("a wake"):
        with turns.engine_change("the rebuild inside it"):  # an EngineSet's wake that rebuilds its engine
            pass
    with turns.training_step():
        pass


def test_a_rebuild_reuses_the_first_starts_kv_cache_and_asks_only_for_free_memory(tmp_path):
    class Engine:
        def kv_cache_bytes(self) -> int:
            return 6 * 2**30

    calls, memory = [], iter([(30 * 2**30, 80 * 2**30)])
    build = TurnTakingBuild(lambda **extra: calls.append(extra) or Engine(), GpuTurns(tmp_path, ("0",)),
                            utilization=0.5, device_memory=lambda: next(memory))
    build()
    build()
    assert calls[0] == {}, "the first start profiles as vLLM does"
    assert calls[1] == {"kv_cache_memory_bytes": 6 * 2**30, "gpu_memory_utilization": 0.3675}
    assert build.starts == 2 and build.kv_cache_bytes == 6 * 2**30


def test_rebuild_kwargs_and_the_trainers_share():
    assert rebuild_engine_kwargs(None, 0.5, 10, 100) == {}
    assert rebuild_engine_kwargs(2**30, 0.4, 90, 100) == {"kv_cache_memory_bytes": 2**30,
                                                         "gpu_memory_utilization": 0.4}
    assert rebuild_engine_kwargs(2**30, 0.4, 0, 100)["gpu_memory_utilization"] == 0.01
    assert trainer_memory_fraction(0.4) == pytest.approx(0.6)
    with pytest.raises(ValueError, match="vllm.gpu_memory_utilization"):
        trainer_memory_fraction(0.5, engines=2)


def test_only_gpu_ranks_of_a_sharing_job_take_turns(tmp_path):
    gpu = DeviceBinding(rank=3, role="trainer", device="cuda:0", gpus=("5",), cuda_visible_devices="5", shared=True)
    cpu = DeviceBinding(rank=1, role="env", device="cpu", gpus=(), cuda_visible_devices=None)
    environ = {"TMPDIR": str(tmp_path)}
    turns = gpu_turns(True, gpu, tmp_path / "run", environ)
    assert turns is not None and turns.gpus == ("5",)
    assert turns.lock_dir == turns_dir(tmp_path / "run", environ) and str(turns.lock_dir).startswith(str(tmp_path))
    assert gpu_turns(False, gpu, tmp_path / "run", environ) is None
    assert gpu_turns(True, cpu, tmp_path / "run", environ) is None
    assert turns_dir(tmp_path / "a", environ) != turns_dir(tmp_path / "b", environ), "two jobs of a node apart"
