"""A vLLM engine whose core runs in a process of its own (rollout/vllm_engine.py `start_llm`, what a GPU rank of
several models runs): when the rank that owns it is killed (mpirun kills the ranks of a job that fails), the
processes vLLM spawned for it die too (rollout/vllm_plugin.py: PR_SET_PDEATHSIG), instead of living on, orphaned,
holding the job's output pipes open so that the job never ends."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm
ROOT = Path(__file__).resolve().parents[1]
OWNER = """
import os, sys, time

def main():
    from marlaas_hpc.rollout import make_engine
    engine = make_engine("vllm", sys.argv[1], work_dir=sys.argv[2], kv_cache_gib=1 / 16, own_process=True,
                         warmup=False)
    print("UP", flush=True)
    time.sleep(600)

if __name__ == "__main__":  # vLLM spawns its core: the main module is imported there again
    main()
"""


def _descendants(pid: int) -> list:
    import psutil

    return psutil.Process(pid).children(recursive=True)


def test_the_engine_processes_die_with_the_rank_that_owns_them(tiny_model_path, tmp_path):
    pytest.importorskip("vllm")
    script = tmp_path / "owner.py"
    script.write_text(OWNER)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    owner = subprocess.Popen([sys.executable, str(script), str(tiny_model_path), str(tmp_path / "engine")],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        assert any(line.strip() == "UP" for line in owner.stdout), "the engine started"  # (vLLM logs to stdout)
        spawned = [p for p in _descendants(owner.pid) if "VLLM" in p.name()]
        assert len(spawned) >= 1, "vLLM's engine core runs in a process of its own"
        owner.send_signal(signal.SIGKILL)
        owner.wait(timeout=30)
        deadline = time.monotonic() + 30
        while any(p.is_running() and p.status() != "zombie" for p in spawned) and time.monotonic() < deadline:
            time.sleep(0.2)
        alive = [p.name() for p in spawned if p.is_running() and p.status() != "zombie"]
        assert not alive, f"orphaned engine processes: {alive}"
    finally:
        owner.kill()
        for process in _descendants(os.getpid()):
            if "VLLM" in process.name():
                process.kill()


def _alive(process) -> bool:
    import psutil

    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _engine_cores(pid: int) -> set:
    return {p for p in _descendants(pid) if p.name() == "VLLM::EngineCore"}


class _Deadline:
    """SIGALRM after `seconds`: a call blocked on a dead core (vLLM's client waits without a timeout) fails the test
    instead of hanging it (lock waits are interrupted by the handler's exception)."""

    def __init__(self, seconds: int):
        self.seconds = seconds

    def __enter__(self):
        def expire(*_):
            raise TimeoutError(f"still blocked {self.seconds} s later (waiting on a dead engine core)")

        self.previous = signal.signal(signal.SIGALRM, expire)
        signal.alarm(self.seconds)

    def __exit__(self, *_):
        signal.alarm(0)
        signal.signal(signal.SIGALRM, self.previous)


def _own_process_engine(tiny_model_path, tmp_path, built: list):
    """A rollout rank's engine (RestartingEngine over an own-process VllmEngine), each build's time in `built`."""
    from marlaas_hpc.rollout import make_engine
    from marlaas_hpc.rollout.restart import RestartingEngine

    def factory():
        built.append(time.monotonic())
        return make_engine("vllm", tiny_model_path, work_dir=tmp_path / "engine", kv_cache_gib=1 / 16,
                           own_process=True, warmup=False, max_loras=2)

    return RestartingEngine(factory)


def _long_requests(tag: str, count: int = 6):
    from marlaas_hpc.rollout import GenerationRequest

    return [GenerationRequest(f"{tag}{i}", "base", None, [1 + i, 2, 3], temperature=1.0, max_new_tokens=48,
                              ignore_stop=True, seed=100 + i) for i in range(count)]


def test_usr2_to_every_engine_process_kills_none(tiny_model_path, tmp_path):
    """Slurm's --signal signals every process of the step, a local launcher each rank's process group: the
    engine's processes ignore USR2 (rollout/vllm_plugin.py), and the engine goes on generating."""
    pytest.importorskip("vllm")
    # processes an earlier test of this pytest process left (Python's resource tracker) are not the engine's
    before = {p.pid for p in _descendants(os.getpid())}
    engine = _own_process_engine(tiny_model_path, tmp_path, [])
    try:
        processes = [p for p in _descendants(os.getpid()) if p.pid not in before]
        assert _engine_cores(os.getpid()), "the engine core runs in a process of its own"
        for process in processes:
            process.send_signal(signal.SIGUSR2)
        time.sleep(1.0)
        dead = [f"{p.pid}" for p in processes if not _alive(p)]
        assert not dead, f"USR2 killed engine processes {dead} of {[p.pid for p in processes]}"
        with _Deadline(120):
            done = engine.generate(_long_requests("after-usr2-"))
        assert len(done) == 6 and all(len(g.completion_ids) == 48 for g in done) and engine.restarts == 0
    finally:
        engine.close()


def test_a_killed_engine_core_is_seen_at_once_and_rebuilt(tiny_model_path, tmp_path):
    """SIGKILL of the engine core mid-generation: the rank's next step raises at once (rollout/vllm_liveness.py),
    RestartingEngine builds a new engine and re-issues the requests in flight, which all finish; nothing waits for
    the job's hang watchdog (fault.hang_timeout_s, 600 s)."""
    pytest.importorskip("vllm")
    built, restarts = [], []
    engine = _own_process_engine(tiny_model_path, tmp_path, built)
    engine.on_restart = lambda cause, count, requests: restarts.append((time.monotonic(), cause, requests))
    try:
        (core,) = _engine_cores(os.getpid())
        requests = _long_requests("r")
        engine.submit(requests)
        done = engine.step()
        in_flight = len(requests) - len(done)
        core.kill()
        killed = time.monotonic()
        with _Deadline(150):
            while engine.has_unfinished():
                done += engine.step()
        assert len(built) == 2 and built[1] - killed < 5, f"the dead core was seen {built[1] - killed:.1f} s later"
        ((rebuilt, cause, reissued),) = restarts
        # vLLM's own monitor may reap the core first: then its exit status is not known to this process
        assert f"(pid {core.pid}) died: " in cause and ("killed by signal 9 (SIGKILL)" in cause
                                                       or "ended (exit status not known here)" in cause), cause
        assert reissued == in_flight > 0, "the requests in flight were issued again"
        assert sorted(g.request_id for g in done) == sorted(r.request_id for r in requests), "each finished once"
        assert all(len(g.completion_ids) == 48 for g in done)
        (new_core,) = _engine_cores(os.getpid())
        assert new_core.pid != core.pid
        print(f"\ncore SIGKILLed: seen after {built[1] - killed:.2f} s, engine rebuilt after {rebuilt - killed:.1f} s")
    finally:
        engine.close()


def test_a_version_retired_after_its_core_died_is_not_lost(tiny_model_path, tmp_path, adapters):
    """A version retires inside a step (a finished request released it) or an unpin; if the core died just before,
    unloading it is a call to a dead core. The engine's book-keeping still moves on (the version is retired, its
    ref handed back) and the dead core is seen at the next call. Before, the unload raised out of the step, whose
    finished requests then stayed in flight in RestartingEngine; its restart re-submitted them under the retired
    version (KeyError) and the rank died (seen once in tests/test_runtime_preempt_vllm.py)."""
    pytest.importorskip("vllm")
    from marlaas_hpc.rollout import AdapterRef
    from marlaas_hpc.rollout.vllm_liveness import EngineCoreDied

    engine = _own_process_engine(tiny_model_path, tmp_path, [])
    try:
        vllm = engine.engine
        vllm.add_adapter(AdapterRef("t", 0, str(adapters["t1"])))
        vllm.pin("t", 0)  # held, as by a request in flight, while v1 supersedes it
        vllm.add_adapter(AdapterRef("t", 1, str(adapters["t2"])))
        (core,) = _engine_cores(os.getpid())
        core.kill()
        with _Deadline(30):
            while vllm._core_watch.cause is None:
                time.sleep(0.05)
        vllm.unpin("t", 0)  # retires v0: its unload would go to the dead core
        assert [a.version for a in vllm.pop_retired()] == [0] and vllm.versions.live("t") == [1]
        with pytest.raises(EngineCoreDied):
            vllm.step()
    finally:
        engine.close()
