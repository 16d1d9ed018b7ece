"""The LoRA delta broadcast group (runtime/delta.py) across processes: gloo on the CPU, NCCL with the buffer on
each member's own GPU, and gloo again when some member has no GPU of its own (a CPU rank, or two members on
one GPU under layout.share_gpus: NCCL refuses a duplicate GPU). Each case is tests/support/delta_scenarios.py under
mpirun, checking every received tensor bit for bit. With several trainer leaders every rollout rank posts the
broadcasts in one job-wide order whatever order their announces arrive in; the leader's bound on posted
broadcasts and its flush wait on the host even where wait() does not (NCCL)."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from support.jobs import rank_program

pytestmark = pytest.mark.mpi


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def run_delta(mode: str, ranks: int) -> dict:
    return rank_program("delta_scenarios.py", mode, ranks)


def test_delta_broadcast_gloo_on_cpu():
    result = run_delta("cpu", 3)
    assert result == {"backend": "gloo", "ok": True, "buffer_devices": ["cpu", "cpu", "cpu"]}


@pytest.mark.gpu
@pytest.mark.skipif(_gpus() < 2, reason="needs 2 CUDA devices")
def test_delta_broadcast_nccl_on_gpus():
    result = run_delta("cuda", 2)
    assert result == {"backend": "nccl", "ok": True, "buffer_devices": ["cuda:0", "cuda:1"]}


@pytest.mark.gpu
@pytest.mark.skipif(_gpus() < 1, reason="needs a CUDA device")
@pytest.mark.parametrize("mode", ["mixed", "same_gpu"])
def test_delta_broadcast_falls_back_to_gloo_without_a_gpu_per_member(mode):
    result = run_delta(mode, 2)
    assert result == {"backend": "gloo", "ok": True, "buffer_devices": ["cpu", "cpu"]}


def test_several_leaders_broadcasts_are_posted_in_one_order_whatever_the_arrival_order():
    """Two trainer leaders, two rollout ranks; rank 2 gets leader 0's announce first and rank 3 leader 1's (the
    other one is held back until each has taken the first). NCCL needs the two channels' broadcasts launched in
    the same order on both rollout ranks: both post them in the job's order (leader 0 announced first), not in
    the order their announces arrived. Gloo would not hang either way, so the order itself is checked."""
    result = run_delta("shuffled", 4)
    assert result == {"ok": True, "posted": {"2": [0, 1], "3": [0, 1]}}


class StreamOrderedWork:
    """What torch's NCCL Work does on a GPU, which no CPU run can show: `wait()` returns at once (it only makes the
    current CUDA stream wait for the collective), and `is_completed()` turns true once the collective has run on
    the device (here: when the test says so)."""

    def __init__(self):
        self.ran = threading.Event()

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return self.ran.is_set()


class DeviceLikeGroup:
    """Stands in for a channel's NCCL group: every broadcast returns a StreamOrderedWork."""

    def __init__(self):
        self.works: list[StreamOrderedWork] = []

    def broadcast(self, tensor, root):
        self.works.append(StreamOrderedWork())
        return self.works[-1]


def test_the_in_flight_bound_and_flush_wait_on_the_host_for_device_broadcasts():
    """A leader alone in its channel (no rollout rank) over a device-like group whose wait() returns before the
    broadcast has run (a failure the CPU cannot provoke: gloo's wait blocks). Below MAX_IN_FLIGHT `send` does not
    wait; past it, it returns only once the oldest broadcast has run; `flush` only once every one has."""
    from mpi4py import MPI

    from marlaas_hpc.runtime.delta.broadcast import DeltaChannel
    from marlaas_hpc.tasks.spec import LoraSpec

    channel = DeltaChannel(MPI.COMM_SELF, 0, [])
    group = channel.process_group = DeviceLikeGroup()
    for version in range(DeltaChannel.MAX_IN_FLIGHT):
        channel.send("t", version, {"w": torch.ones(3)}, LoraSpec(rank=4))
    assert len(channel.in_flight) == DeltaChannel.MAX_IN_FLIGHT and not any(w.is_completed() for w in group.works)
    threading.Timer(0.2, group.works[0].ran.set).start()  # the device runs the oldest broadcast a little later
    channel.send("t", DeltaChannel.MAX_IN_FLIGHT, {"w": torch.ones(3)}, LoraSpec(rank=4))
    assert group.works[0].is_completed(), "send went past the bound before the oldest broadcast had run"
    assert len(channel.in_flight) == DeltaChannel.MAX_IN_FLIGHT

    def run_the_rest():
        for work in group.works[1:]:
            time.sleep(0.005)
            work.ran.set()

    threading.Thread(target=run_the_rest).start()
    channel.flush()
    assert all(w.is_completed() for w in group.works) and not channel.in_flight, "flush returned early"
