"""Joined and replacement rollout ranks get a GPU of their own in local mode (issue #36 item 4): rank 0 knows which
GPUs each live rank holds (their bindings at start), gives a joiner free ones and a replacement the dead rank's,
and the joiner binds them before MPI starts (`--gpus`, runtime/join.py). Before, a joiner in local mode took
cuda:0, which another rank held. The node's GPUs are a simulated device list: no GPU here."""
from pathlib import Path

import pytest

from marlaas_hpc.config import JobConfig
from marlaas_hpc.launch.devices import DeviceBinding, DeviceError, joined_binding, joiner_gpus
from marlaas_hpc.runtime import membership
from marlaas_hpc.runtime.membership import Membership
from marlaas_hpc.runtime.scaling import Scaler

ROOT = Path(__file__).resolve().parents[1]
NODE = ("0", "1", "2", "3", "4", "5", "6", "7")


def test_a_replacement_takes_the_dead_rank_s_gpus_and_a_new_rank_the_first_free_ones():
    held = {2: ("0",), 3: ("1",), 5: ("2",), 6: ("3",)}  # rollout 2, 3; trainers 5, 6
    assert joiner_gpus(NODE, held, need=1) == ("4",)
    assert joiner_gpus(NODE, {r: g for r, g in held.items() if r != 3}, need=1, replaces=("1",)) == ("1",)
    assert joiner_gpus(NODE, held, need=2) == ("4", "5")  # an engine with tensor parallelism 2


def test_no_free_gpu_refuses_the_joiner_naming_the_field():
    with pytest.raises(DeviceError) as refused:
        joiner_gpus(("0", "1"), {2: ("0",), 5: ("1",)}, need=1)
    assert refused.value.field == "layout.rollout.gpus_per_task"


def test_the_joined_binding_narrows_cuda_visible_devices_to_its_gpus():
    binding = joined_binding(9, ["4"])
    assert (binding.device, binding.gpus, binding.cuda_visible_devices) == ("cuda:0", ("4",), "4")
    assert joined_binding(9, []).device == "cpu"


class _Comm:
    """What Scaler uses of rank 0's LiveComm: its membership, and a link to each rank it starts."""

    def __init__(self, members):
        self.members, self.links = members, {}

    def add_link(self, rank: int, link) -> None:
        self.links[rank] = link


def _gpu(rank: int, role: str, gpu: str) -> DeviceBinding:
    return DeviceBinding(rank=rank, role=role, device="cuda:0", gpus=(gpu,), cuda_visible_devices=gpu)


def _scaler(monkeypatch, tmp_path) -> tuple[Scaler, list]:
    job = JobConfig.load(ROOT / "configs" / "local-demo.yaml")
    job.run_dir = str(tmp_path)
    job.layout.rollout_ranks = 2  # ranks: 0 scheduler, 1 env, 2 and 3 rollout, 4 trainer; joiners from 5 on
    roles = {"env": [1], "rollout": [2, 3], "trainer": [4]}
    assert job.layout.world_size == 5
    members = Membership(roles, tolerant=True)
    scaler = Scaler(_Comm(members), job, tmp_path)
    started: list = []
    monkeypatch.setattr(membership, "spawn_rank", lambda argv, host=None: started.append(argv) or object())
    bindings = [DeviceBinding(rank=0, role="scheduler", device="cpu", gpus=(), cuda_visible_devices=""),
                _gpu(2, "rollout", "0"), _gpu(3, "rollout", "1"), _gpu(4, "trainer", "2")]
    scaler.know_devices(bindings, NODE[:4])
    return scaler, started


def _gpus_of(argv: list[str]) -> str | None:
    return argv[argv.index("--gpus") + 1] if "--gpus" in argv else None


def test_rank_0_gives_a_scale_up_joiner_a_free_gpu_and_a_replacement_the_dead_rank_s(monkeypatch, tmp_path):
    scaler, started = _scaler(monkeypatch, tmp_path)
    rank, _ = scaler.spawn()  # marlaas scale 2 -> 3
    assert _gpus_of(started[-1]) == "3" and scaler.gpus[rank] == ("3",)
    scaler.release(3)  # rollout rank 3 lost: its GPU 1 goes to its replacement
    scaler.spawn(replaces=3)
    assert _gpus_of(started[-1]) == "1"
    scaler.release(rank)  # the joined rank drains: its GPU is free for the next joiner
    scaler.spawn()
    assert _gpus_of(started[-1]) == "3"
    with pytest.raises(DeviceError):  # every GPU of the node is held now
        scaler.spawn()


def test_a_cpu_job_s_joiner_gets_no_gpus(monkeypatch, tmp_path):
    scaler, started = _scaler(monkeypatch, tmp_path)
    scaler.know_devices([DeviceBinding(rank=r, role="rollout", device="cpu", gpus=(), cuda_visible_devices=None)
                         for r in (2, 3)], ())
    scaler.visible = ()
    scaler.spawn()
    assert _gpus_of(started[-1]) is None
