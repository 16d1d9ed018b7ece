"""Checkpoint shards of GPU tensors are written from host memory (runtime/checkpoint.py `on_host`): a shard that
named its GPU could not be loaded where that device is missing (a CPU-only machine reading a checkpoint)."""
import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_a_shard_of_gpu_tensors_loads_as_host_tensors_without_a_map_location(tmp_path):
    from marlaas_hpc.runtime.checkpoint import save_torch

    state = {"adapter": {"w": torch.ones(4, device="cuda")}, "optimizer": [torch.zeros(2, device="cuda")]}
    save_torch(state, tmp_path / "shard.pt")
    loaded = torch.load(tmp_path / "shard.pt", weights_only=False)  # no map_location: the file's own devices
    assert loaded["adapter"]["w"].device.type == "cpu" and loaded["optimizer"][0].device.type == "cpu"
    assert torch.equal(loaded["adapter"]["w"], torch.ones(4))
