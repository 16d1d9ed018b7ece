"""Device binding (launch/devices.py) from recorded environments: every rank of a job gets the device the rule
says, no two GPU ranks of a node share a GPU unless layout.share_gpus, and impossible placements are refused
naming the field to change.

Environments: tests/golden/slurm_env/ (a het job with --gpus-per-task=1 on several nodes) and
tests/golden/device_env/ (a het job whose one rollout engine has --gpus-per-task=2; one srun step on one node
with --gres=gpu:8; `mpirun -np 8` on one machine), recorded by slurm/local-cluster/record_env.py on the local
Slurm cluster (fake GPUs: Slurm sets the variables as on a real site; the driver's GPU count is the test's).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from marlaas_hpc.config import JobConfig
from marlaas_hpc.launch.devices import (DeviceError, apply_binding, bind_device, count_driver_gpus,
                                        node_ranks_from_env, placement_mismatch, visible_gpus, world_rank_from_env)
from marlaas_hpc.launch.layout import ComponentResources, JobLayout, LayoutError

GOLDEN = Path(__file__).parent / "golden"


def _recorded(path: str) -> list[dict[str, str]]:
    return json.loads((GOLDEN / path).read_text())


def _rank(env: dict[str, str]) -> int:
    return int(env.get("OMPI_COMM_WORLD_RANK") or env["SLURM_PROCID"])


def _bind_all(envs, layout, driver_gpus, node_ranks=None):
    """driver_gpus: GPUs on every node, or a function of a rank's environment (CPU and GPU nodes differ)."""
    count = driver_gpus if callable(driver_gpus) else (lambda env: driver_gpus)
    return [bind_device(env, _rank(env), layout, driver_gpus=count(env), node_ranks=node_ranks) for env in envs]


def _gpu_nodes_with(count):
    """The local cluster's nodes: g* are GPU nodes, c* CPU nodes."""
    return lambda env: count if env["SLURMD_NODENAME"].startswith("g") else 0


def _assert_no_shared_gpu(envs, bindings):
    """Physical GPU = (node, Slurm's id): SLURM_STEP_GPUS lists, position by position, the GPUs behind the
    task's CUDA_VISIBLE_DEVICES (which a cgroup may renumber from 0)."""
    seen = {}
    for env, binding in zip(envs, bindings):
        node = env.get("SLURMD_NODENAME", "localhost")
        cuda, step = env.get("CUDA_VISIBLE_DEVICES", ""), env.get("SLURM_STEP_GPUS")
        physical = dict(zip(cuda.split(","), step.split(","))) if step else {}
        for gpu in (physical.get(g, g) for g in binding.gpus):
            assert (node, gpu) not in seen, f"rank {binding.rank} and rank {seen[(node, gpu)]} share GPU {gpu}"
            seen[(node, gpu)] = binding.rank
    return seen


def _gpu_layout(rollout_ranks=2, rollout_gpus=1, trainer_tp=2, **extra) -> JobLayout:
    return JobLayout(env_ranks=1, rollout_ranks=rollout_ranks, trainer_tp=trainer_tp,
                     rollout=ComponentResources(gpus_per_task=rollout_gpus),
                     trainer=ComponentResources(gpus_per_task=1), **extra).validate()


# ------------------------------------------------------------------------------ recorded environments
@pytest.mark.parametrize("recording", ["het_1_1_2_2.json", "het_1_1_2_2_rollout_2_nodes.json"])
def test_device_binding_several_nodes_gpus_per_task_1(recording):
    envs = _recorded(f"slurm_env/{recording}")
    bindings = _bind_all(envs, _gpu_layout(), driver_gpus=_gpu_nodes_with(4))
    assert [b.role for b in bindings] == ["scheduler", "env", "rollout", "rollout", "trainer", "trainer"]
    for env, binding in zip(envs, bindings):
        if binding.role in ("scheduler", "env"):
            assert binding.device == "cpu" and binding.gpus == () and binding.cuda_visible_devices is None
        else:  # each task sees its own GPU (Slurm's per-task binding): it runs there, as cuda:0
            assert binding.device == "cuda:0" and binding.gpus == (env["CUDA_VISIBLE_DEVICES"],)
            assert binding.cuda_visible_devices == env["CUDA_VISIBLE_DEVICES"] and not binding.shared
    assert len(_assert_no_shared_gpu(envs, bindings)) == 4


def test_device_binding_trainer_gpus_per_node():
    """The TP trainer as launch/sbatch.py renders it (--gpus-per-node=2 --ntasks-per-node=2, recorded on the local
    cluster): both TP ranks see both GPUs of their node, and the node-pool rule gives each its own one, narrowed
    to it; engines keep their per-task GPU."""
    envs = _recorded("device_env/het_trainer_gpus_per_node.json")
    assert [env.get("CUDA_VISIBLE_DEVICES") for env in envs][2:] == ["0", "1", "0,1", "0,1"]
    bindings = _bind_all(envs, _gpu_layout(), driver_gpus=_gpu_nodes_with(4))
    assert [(b.gpus, b.cuda_visible_devices) for b in bindings[2:]] == [(("0",), "0"), (("1",), "1"),
                                                                         (("0",), "0"), (("1",), "1")]
    assert [b.how.split(" (")[0] for b in bindings[2:]] == ["Slurm per-task binding"] * 2 + ["node pool of 2"] * 2
    assert len(_assert_no_shared_gpu(envs, bindings)) == 4


def test_device_binding_one_node_8_gpus_shared_by_rollout_and_trainer_mpirun():
    """mpirun -np 8 on one 8-GPU machine: 2 engines of TP=2 and a TP=4 trainer split the node's GPUs."""
    envs = _recorded("device_env/mpirun_one_node_8_ranks.json")
    layout = _gpu_layout(rollout_ranks=2, rollout_gpus=2, trainer_tp=4)
    bindings = _bind_all(envs, layout, driver_gpus=8)
    assert [b.gpus for b in bindings] == [(), (), ("0", "1"), ("2", "3"), ("4",), ("5",), ("6",), ("7",)]
    assert [b.cuda_visible_devices for b in bindings[2:]] == ["0,1", "2,3", "4", "5", "6", "7"]
    assert all(b.device == "cuda:0" and not b.shared and "node pool of 8" in b.how for b in bindings[2:])
    # the scheduler and env ranks see no GPU once bound (nothing to hide here: CUDA_VISIBLE_DEVICES unset)
    assert [b.device for b in bindings[:2]] == ["cpu", "cpu"]


def test_device_binding_one_node_keeps_the_users_gpu_selection():
    envs = [dict(env, CUDA_VISIBLE_DEVICES="GPU-a1,GPU-b2,GPU-c3,GPU-d4,GPU-e5,GPU-f6,GPU-a7,GPU-b8")
            for env in _recorded("device_env/mpirun_one_node_8_ranks.json")]
    bindings = _bind_all(envs, _gpu_layout(rollout_ranks=2, rollout_gpus=2, trainer_tp=4), driver_gpus=16)
    assert [b.cuda_visible_devices for b in bindings] == ["", "", "GPU-a1,GPU-b2", "GPU-c3,GPU-d4", "GPU-e5",
                                                          "GPU-f6", "GPU-a7", "GPU-b8"]


def test_device_binding_one_node_8_gpus_srun_without_per_task_binding():
    """srun on one node with --gres=gpu:8: every task sees all 8 (SLURM_GPUS_ON_NODE=8), so the node is a pool."""
    envs = _recorded("device_env/srun_one_node_8_gpus.json")
    assert all(env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7" for env in envs)
    bindings = _bind_all(envs, _gpu_layout(rollout_ranks=2, rollout_gpus=2, trainer_tp=4), driver_gpus=8)
    assert [b.gpus for b in bindings] == [(), (), ("0", "1"), ("2", "3"), ("4",), ("5",), ("6",), ("7",)]
    assert bindings[0].cuda_visible_devices == "" == bindings[1].cuda_visible_devices  # hidden from CPU ranks
    assert len(_assert_no_shared_gpu(envs, bindings)) == 8


def test_device_binding_rollout_engine_with_tp2():
    """A het job whose rollout task has --gpus-per-task=2: the engine owns both GPUs of its node."""
    envs = _recorded("device_env/het_rollout_tp2.json")
    layout = _gpu_layout(rollout_ranks=1, rollout_gpus=2, trainer_tp=2)
    bindings = _bind_all(envs, layout, driver_gpus=_gpu_nodes_with(2))
    rollout = bindings[2]
    assert rollout.role == "rollout" and rollout.gpus == ("0", "1") and rollout.cuda_visible_devices == "0,1"
    assert [b.gpus for b in bindings[3:]] == [("0",), ("1",)] and "per-task" in bindings[3].how
    _assert_no_shared_gpu(envs, bindings)
    job = JobConfig.from_dict({"layout": {"rollout_ranks": 1, "trainer_tp": 2, "rollout": {"gpus_per_task": 2},
                                          "trainer": {"gpus_per_task": 1}},
                               "vllm": {"tensor_parallel_size": 2, "dtype": "bfloat16"}})
    kwargs = job.vllm.engine_kwargs(job.max_adapters, job.max_lora_rank, job.largest_staleness())
    assert kwargs["tensor_parallel_size"] == 2


def test_device_binding_cpu_only():
    envs = _recorded("device_env/mpirun_one_node_8_ranks.json")
    bindings = _bind_all(envs, _gpu_layout(rollout_ranks=2, rollout_gpus=2, trainer_tp=4), driver_gpus=0)
    assert all(b.device == "cpu" and b.gpus == () and b.cuda_visible_devices is None for b in bindings)
    assert "no GPU visible" in bindings[2].how


def test_device_binding_fake_gpus_run_the_cpu_twin():
    """The local Slurm cluster's GPUs are fake: Slurm names them, the driver lists none. 'auto' runs on the CPU
    (and hides them); 'cuda' refuses."""
    envs = _recorded("slurm_env/het_1_1_2_2.json")
    bindings = _bind_all(envs, _gpu_layout(), driver_gpus=0)
    assert all(b.device == "cpu" for b in bindings)
    assert [b.cuda_visible_devices for b in bindings] == [None, None, "", "", "", ""]
    assert "driver lists none" in bindings[2].how
    with pytest.raises(DeviceError, match="driver lists no NVIDIA GPU") as info:
        bind_device(envs[2], 2, _gpu_layout(accelerator="cuda"), driver_gpus=0)
    assert info.value.field == "layout.accelerator"
    assert bind_device(envs[0], 0, _gpu_layout(accelerator="cuda"), driver_gpus=0).device == "cpu"


def test_device_binding_accelerator_cpu_ignores_gpus():
    envs = _recorded("device_env/srun_one_node_8_gpus.json")
    bindings = _bind_all(envs, _gpu_layout(rollout_ranks=2, rollout_gpus=2, trainer_tp=4, accelerator="cpu"),
                         driver_gpus=8)
    assert all(b.device == "cpu" and b.cuda_visible_devices == "" for b in bindings)


# ------------------------------------------------------------------------------ sharing and refusals
def test_device_refuses_too_few_gpus_unless_shared():
    envs = _recorded("device_env/mpirun_one_node_8_ranks.json")
    layout = _gpu_layout(rollout_ranks=2, rollout_gpus=2, trainer_tp=4)
    with pytest.raises(DeviceError, match=r"2 rollout, 4 trainer rank\(s\) needing 8 GPUs but 6 are visible") as info:
        bind_device(envs[4], 4, layout, driver_gpus=6)
    assert info.value.field == "layout.share_gpus" and "share_gpus: true" in str(info.value)
    shared = _bind_all(envs, _gpu_layout(rollout_ranks=2, rollout_gpus=2, trainer_tp=4, share_gpus=True),
                       driver_gpus=6)
    # trainers from the front, engines from the back: only GPUs 2 and 3 serve both
    assert [b.gpus for b in shared[2:]] == [("4", "5"), ("2", "3"), ("0",), ("1",), ("2",), ("3",)]
    assert [b.shared for b in shared[2:]] == [False, True, False, False, True, True]


def test_device_share_gpus_puts_engine_and_trainer_on_one_gpu():
    """Issue #14's single-GPU step: one vLLM engine and a TP=1 trainer on the machine's one GPU (the world
    of 4 ranks comes from MPI's node split, as main.py passes it)."""
    envs = _recorded("device_env/mpirun_one_node_8_ranks.json")[:4]
    layout = JobLayout(rollout_ranks=1, trainer_tp=1).validate()
    with pytest.raises(DeviceError, match="needing 2 GPUs but 1 are visible"):
        bind_device(envs[2], 2, layout, driver_gpus=1, node_ranks=[0, 1, 2, 3])
    layout = JobLayout(rollout_ranks=1, trainer_tp=1, share_gpus=True).validate()
    bindings = _bind_all(envs, layout, driver_gpus=1, node_ranks=[0, 1, 2, 3])
    assert [(b.role, b.gpus, b.shared) for b in bindings[2:]] == [("rollout", ("0",), True),
                                                                  ("trainer", ("0",), True)]


def test_device_refuses_sharing_within_the_trainer_group():
    envs = _recorded("device_env/mpirun_one_node_8_ranks.json")[:5]
    layout = JobLayout(rollout_ranks=1, trainer_tp=2, share_gpus=True).validate()
    with pytest.raises(DeviceError, match="even with layout.share_gpus, the trainer ranks") as info:
        bind_device(envs[3], 3, layout, driver_gpus=1, node_ranks=range(5))
    assert info.value.field == "layout.trainer_tp"


def test_device_refuses_a_tp2_engine_bound_to_one_gpu():
    """Submitted with --gpus-per-task=1 while the engine needs 2 (layout.rollout.gpus_per_task=2)."""
    envs = _recorded("slurm_env/het_1_1_2_2.json")
    with pytest.raises(DeviceError, match=r"needs 2 GPU\(s\) but Slurm bound it to 1") as info:
        bind_device(envs[2], 2, _gpu_layout(rollout_gpus=2), driver_gpus=4)
    assert info.value.field == "layout.rollout.gpus_per_task" and "--gpus-per-task=2" in str(info.value)


def test_device_refuses_cuda_without_gpus_for_gpu_roles_only():
    envs = _recorded("device_env/mpirun_one_node_8_ranks.json")
    layout = _gpu_layout(rollout_ranks=2, rollout_gpus=2, trainer_tp=4, accelerator="cuda")
    assert bind_device(envs[1], 1, layout, driver_gpus=0).device == "cpu"
    with pytest.raises(DeviceError, match=r"rank 5 \(trainer\) cannot use a GPU: it sees no GPU") as info:
        bind_device(envs[5], 5, layout, driver_gpus=0)
    assert info.value.field == "layout.accelerator"


@pytest.mark.parametrize("value", ["0,0", "0,,1"])
def test_device_refuses_malformed_visible_devices(value):
    env = dict(_recorded("device_env/mpirun_one_node_8_ranks.json")[4], CUDA_VISIBLE_DEVICES=value)
    with pytest.raises(DeviceError, match="distinct GPU ids"):
        bind_device(env, 4, _gpu_layout(rollout_ranks=2, rollout_gpus=2, trainer_tp=4), driver_gpus=8)


def test_device_layout_fields_are_validated():
    with pytest.raises(LayoutError, match=r"one of \['auto', 'cpu', 'cuda'\]") as info:
        JobLayout(accelerator="gpu").validate()
    assert info.value.field == "accelerator"
    with pytest.raises(LayoutError, match="trainer rank drives one GPU") as info:
        JobLayout(trainer=ComponentResources(gpus_per_task=2)).validate()
    assert info.value.field == "trainer.gpus_per_task"
    with pytest.raises(LayoutError, match="expected true or false") as info:
        JobLayout.from_dict({"share_gpus": "yes"})
    assert info.value.field == "share_gpus"


# ------------------------------------------------------------------------------ pieces
def test_device_binding_is_pure_and_apply_sets_the_environment(monkeypatch):
    env = dict(_recorded("slurm_env/het_1_1_2_2.json")[3])
    before = dict(env)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "untouched")
    binding = bind_device(env, 3, _gpu_layout(), driver_gpus=0)
    assert env == before and bind_device(env, 3, _gpu_layout(), driver_gpus=0) == binding
    import os

    assert os.environ["CUDA_VISIBLE_DEVICES"] == "untouched"
    apply_binding(binding, env)  # a CPU binding: hides the (fake) GPU, starts nothing
    assert env["CUDA_VISIBLE_DEVICES"] == ""
    plain = {"OMPI_COMM_WORLD_RANK": "0"}
    apply_binding(bind_device(plain, 0, JobLayout(), driver_gpus=0, node_ranks=[0]), plain)
    assert "CUDA_VISIBLE_DEVICES" not in plain


def test_device_node_ranks_from_launcher_variables():
    srun = _recorded("slurm_env/het_1_1_2_2.json")
    assert [node_ranks_from_env(env) for env in srun] == [[0], [1], [2, 3], [2, 3], [4, 5], [4, 5]]
    mpirun = _recorded("device_env/mpirun_one_node_8_ranks.json")
    assert node_ranks_from_env(mpirun[5]) == list(range(8))
    # mpirun inside an allocation: its daemons' SLURM_* variables must not win over Open MPI's
    inside = dict(mpirun[5], SLURM_GTIDS="0", SLURM_STEP_ID="0", SLURM_PROCID="0")
    assert node_ranks_from_env(inside) == list(range(8))
    mpich = {"PMI_RANK": "6", "MPI_LOCALRANKID": "2", "MPI_LOCALNRANKS": "4"}
    assert node_ranks_from_env(mpich) == [4, 5, 6, 7]


def test_device_visible_gpus_sources():
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "2,3"}, 8) == (("2", "3"), "CUDA_VISIBLE_DEVICES")
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}, 8) == ((), "CUDA_VISIBLE_DEVICES")
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "NoDevFiles"}, 8) == ((), "CUDA_VISIBLE_DEVICES")
    assert visible_gpus({"SLURM_STEP_GPUS": "1", "SLURM_JOB_GPUS": "0,1"}, 8) == (("1",), "SLURM_STEP_GPUS")
    assert visible_gpus({}, 3) == (("0", "1", "2"), "the driver")


def test_count_driver_gpus_device_files(tmp_path):
    proc = tmp_path / "proc"
    for bus in ("0000:17:00.0", "0000:65:00.0"):
        (proc / bus).mkdir(parents=True)
    assert count_driver_gpus(str(proc), str(tmp_path / "none")) == 2
    dev = tmp_path / "dev"
    dev.mkdir()
    for name in ("nvidia0", "nvidia1", "nvidia2", "nvidiactl", "nvidia-uvm", "null"):
        (dev / name).touch()
    assert count_driver_gpus(str(tmp_path / "none"), str(dev)) == 3
    assert count_driver_gpus(str(tmp_path / "none"), str(tmp_path / "none")) == 0


APPLY_ON_THIS_MACHINE = """
import json, os
from marlaas_hpc.launch.devices import apply_binding, bind_device, count_driver_gpus
from marlaas_hpc.launch.layout import JobLayout

layout = JobLayout(rollout_ranks=1, trainer_tp=1, share_gpus=True).validate()
binding = bind_device(os.environ, 3, layout, driver_gpus=count_driver_gpus(), node_ranks=range(4))
apply_binding(binding)
import torch
from marlaas_hpc.launch.devices import gpu_local_cpus, pci_address
print(json.dumps({"driver": count_driver_gpus(), "device": binding.device, "gpus": binding.gpus,
                  "torch_count": torch.cuda.device_count(), "current": torch.cuda.current_device(),
                  "affinity": sorted(os.sched_getaffinity(0)), "node_cpus": os.cpu_count(),
                  "gpu_cpus": sorted(gpu_local_cpus([pci_address(torch.cuda.get_device_properties(0))]) or [])}))
"""


@pytest.mark.gpu
def test_device_binding_applied_on_a_real_gpu():
    """A fresh process (CUDA not started yet): the driver count is right, and the trainer rank of a one-node job
    sees exactly its own GPU as cuda:0 after apply_binding."""
    import subprocess
    import sys

    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    proc = subprocess.run([sys.executable, "-c", APPLY_ON_THIS_MACHINE], capture_output=True, text=True,
                          timeout=300, cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["driver"] >= 1 and result["device"] == "cuda:0" and len(result["gpus"]) == 1
    assert result["torch_count"] == 1 and result["current"] == 0
    assert result["gpu_cpus"], "the kernel lists the CPUs near the GPU (sysfs local_cpulist of its PCI address)"
    assert set(result["affinity"]) <= set(result["gpu_cpus"]), "the rank runs on the CPUs near its GPU"
    print(f"\nGPU rank affinity: {len(result['affinity'])} of {result['node_cpus']} CPUs, near the GPU: "
          f"{len(result['gpu_cpus'])}")


@pytest.mark.mpi
def test_device_refusal_stops_every_rank_under_mpirun(tmp_path):
    """`layout.accelerator: cuda` on a machine without GPUs: every rank stops (no rank left waiting in MPI),
    the message names the field, exit status 2."""
    import torch

    from support.configs import small_config
    from support.jobs import run_marlaas

    if count_driver_gpus() or torch.cuda.is_available():
        pytest.skip("this machine has GPUs")
    config = small_config()
    config["layout"] = dict(config["layout"], accelerator="cuda")
    proc, run_dir = run_marlaas(config, tmp_path, timeout=300)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "marlaas: layout.accelerator: is 'cuda' but rank 2 (rollout) cannot use a GPU" in proc.stderr
    assert "rank 3 (trainer)" in proc.stderr and not (run_dir / "summary.json").exists()


# ------------------------------------------------------------------- bound before MPI_Init, checked after it
def test_device_world_rank_from_launcher_variables():
    srun = _recorded("slurm_env/het_1_1_2_2.json")
    assert [world_rank_from_env(env) for env in srun] == list(range(6))
    mpirun = _recorded("device_env/mpirun_one_node_8_ranks.json")
    assert [world_rank_from_env(env) for env in mpirun] == list(range(8))
    assert world_rank_from_env(dict(mpirun[5], SLURM_PROCID="0", SLURM_GTIDS="0", SLURM_STEP_ID="0")) == 5
    assert world_rank_from_env({"PMI_RANK": "6", "MPI_LOCALRANKID": "2", "MPI_LOCALNRANKS": "4"}) == 6
    assert world_rank_from_env({}) == 0  # started alone


def test_device_placement_from_launcher_variables_checked_against_mpi():
    """mpirun's variables assume block placement; MPI's shared-memory split knows the truth. A rank whose binding
    the truth would change is refused, naming the variables and what to change; node lists that differ without
    changing the binding (CPU ranks, or a job without GPUs) are no error."""
    layout = _gpu_layout(rollout_ranks=2, trainer_tp=2)  # ranks 0 sched, 1 env, 2-3 rollout, 4-5 trainer
    env = {"OMPI_COMM_WORLD_RANK": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "4", "OMPI_COMM_WORLD_LOCAL_SIZE": "6",
           "CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    applied = bind_device(env, 4, layout, driver_gpus=4)
    assert applied.gpus == ("2",)  # the 3rd GPU rank of ranks 0..5
    assert placement_mismatch(env, layout, 4, applied, 4, range(6)) is None
    cyclic = [0, 2, 4]  # --map-by node over two nodes: ranks 0, 2, 4 share this one
    message = placement_mismatch(env, layout, 4, applied, 4, cyclic)
    assert message.startswith("rank 4: its device was chosen before MPI_Init from the launcher's variables "
                              "(OMPI_COMM_WORLD_RANK/OMPI_COMM_WORLD_LOCAL_RANK/OMPI_COMM_WORLD_LOCAL_SIZE: world "
                              "rank 4, node ranks [0, 1, 2, 3, 4, 5]), but MPI places it as world rank 4 among "
                              "node ranks [0, 2, 4]"), message
    assert "GPU 2 as cuda:0" in message and "GPU 1 as cuda:0" in message and "--map-by slot" in message
    cpu_rank = bind_device(dict(env, OMPI_COMM_WORLD_RANK="1", OMPI_COMM_WORLD_LOCAL_RANK="1"), 1, layout,
                           driver_gpus=4)
    assert placement_mismatch(dict(env, OMPI_COMM_WORLD_RANK="1"), layout, 4, cpu_rank, 1, [1, 3, 5]) is None
    no_driver = bind_device(env, 4, layout, driver_gpus=0)
    assert placement_mismatch(env, layout, 0, no_driver, 4, cyclic) is None  # every rank on the CPU anyway
    wrong_rank = placement_mismatch(env, layout, 4, applied, 5, range(6))  # MPI's rank is not the launcher's
    assert "world rank 4" in wrong_rank and "as world rank 5" in wrong_rank


# ---- CPUs near the GPUs: a fake sysfs (this machine has no GPU; tests/test_launch_devices.py's GPU test reads a
# real one)
def _sysfs(tmp_path, devices: dict[str, str]) -> Path:
    for address, cpulist in devices.items():
        (tmp_path / address).mkdir(parents=True)
        (tmp_path / address / "local_cpulist").write_text(cpulist + "\n")
    return tmp_path


def test_cpus_near_a_gpu_come_from_its_pci_devices_local_cpulist(tmp_path):
    from marlaas_hpc.launch.devices import cpus_near, gpu_local_cpus, parse_cpulist

    assert parse_cpulist("0-3,8-11") == {0, 1, 2, 3, 8, 9, 10, 11} and parse_cpulist("5\n") == {5}
    sysfs = _sysfs(tmp_path, {"0000:1b:00.0": "0-23,96-119", "0000:9c:00.0": "48-71,144-167"})
    assert gpu_local_cpus(["0000:9C:00.0"], sysfs) == set(range(48, 72)) | set(range(144, 168))
    assert gpu_local_cpus(["0000:1b:00.0", "0000:9c:00.0"], sysfs) == parse_cpulist("0-23,48-71,96-119,144-167")
    assert gpu_local_cpus(["0000:aa:00.0"], sysfs) is None, "a device the kernel does not list: nothing known"
    node = set(range(192))
    assert cpus_near(node, gpu_local_cpus(["0000:9c:00.0"], sysfs)) == set(range(48, 72)) | set(range(144, 168))
    assert cpus_near({48, 49, 50, 0}, {48, 49, 50, 51}) == {48, 49, 50}, "within what the launcher allowed"
    assert cpus_near({0, 1}, {48, 49}) is None, "nothing in common: the rank keeps its CPUs"
    assert cpus_near({0, 1}, None) is None and cpus_near({48, 49}, {48, 49, 50}) is None


def test_a_gpu_rank_binds_itself_to_the_cpus_near_its_gpu(tmp_path):
    """In a fresh process (its affinity is the test's to change): the CPUs near the GPU among those allowed."""
    import os
    import subprocess
    import sys

    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip("needs two CPUs to narrow from")
    sysfs = _sysfs(tmp_path, {"0000:9c:00.0": str(allowed[-1])})
    code = ("import json, os; from marlaas_hpc.launch.devices import bind_cpus_near; "
            f"chosen = bind_cpus_near(['0000:9c:00.0'], {str(sysfs)!r}); "
            "print(json.dumps([sorted(chosen or []), sorted(os.sched_getaffinity(0))]))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout) == [[allowed[-1]], [allowed[-1]]]
