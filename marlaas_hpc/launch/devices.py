"""Which device each rank of a job uses: one pure function of the rank's environment, the layout and the
node's GPU count (docs/architecture.md §2).

The rule (`bind_device`):
- Scheduler and env ranks run on the CPU. Rollout ranks need `layout.rollout.gpus_per_task` GPUs (at least
  one: their engine's tensor_parallel_size); trainer ranks one each (a TP group is one process per GPU).
- The GPUs a rank may use are those it sees: CUDA_VISIBLE_DEVICES, else SLURM_STEP_GPUS / SLURM_JOB_GPUS,
  else every GPU the driver lists on the node.
- Per-task binding: in an srun step whose tasks each see fewer GPUs than the node holds for the job
  (SLURM_GPUS_ON_NODE; --gpus-per-task binds each task to its own by default, as do --gpu-bind=per_task /
  map_gpu), a rank uses the GPUs it sees.
- Node pool: otherwise (mpirun; srun with --gres=gpu:N or --gpus-per-node, --gpu-bind=none) every rank of a
  node sees the same GPUs, and the node's GPU ranks take consecutive slices of them in world-rank order.
- Rollout and trainer ranks never share a GPU: a node whose GPU ranks need more GPUs than it has is refused,
  unless `layout.share_gpus` says so; then trainer ranks take GPUs from the front and rollout engines from the
  back, so only the overlap is shared, and trainer ranks (one NCCL group) and engines stay distinct among
  themselves.
- `layout.accelerator`: 'auto' uses GPUs when the driver lists some on the node and the rank is given some
  (so the CPU twin runs where the GPUs are fake, e.g. the local Slurm cluster), 'cuda' refuses a GPU rank
  without GPUs, 'cpu' never uses them.

A rank then runs with CUDA_VISIBLE_DEVICES narrowed to its own GPUs (`apply_binding`), so torch, NCCL and vLLM
(its tensor-parallel workers included) see them as cuda:0 .. n-1, and a CPU rank on a GPU node sees none. NCCL
still uses NVLink / P2P between ranks narrowed this way: it finds peers by PCI bus id and, since CUDA 10.1,
connects to devices this process cannot see through CUDA IPC (nccl src/transport/p2p.cc, p2pCanConnect). What
breaks P2P is a devices cgroup that hides the peers' device files (srun --gpus-per-task on sites with
ConstrainDevices, NVIDIA/nccl#1066): the trainer component asks for GPUs per node instead (launch/sbatch.py).

CPUs: a GPU rank narrows its CPU affinity to the CPUs the kernel lists as local to its GPU(s) (their PCI device's
`local_cpulist`: the socket or NUMA node the GPU hangs off), within what its launcher allowed it (`bind_cpus_near`).
The ULFM launcher starts ranks with `--bind-to none` (PRRTE cannot know which GPU a rank will drive), so a rank
driving GPU 7 otherwise floated over every core of the node, the other socket's included. A CPU rank, and a rank
whose GPUs' CPUs lie outside what it was allowed, keeps its affinity (the CPU twin oversubscribes its cores).

The binding is applied before MPI_Init (runtime/process.py `bind_rank_device`): a CUDA-aware MPI transport (UCX)
may start CUDA inside MPI_Init, after which CUDA_VISIBLE_DEVICES no longer counts. So the rank and the ranks
sharing its node come from the launcher's variables (`world_rank_from_env`, `node_ranks_from_env`: SLURM_PROCID
and SLURM_GTIDS under srun; Open MPI's / MPICH's rank, local rank and size under mpirun, which assumes block
placement), and once MPI is up `placement_mismatch` compares them with MPI's own placement (a shared-memory split
of the world) and refuses a rank whose binding they would change.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, MutableMapping, Sequence

from marlaas_hpc.launch.layout import JobLayout, LayoutError, assign_role

GPU_ROLES = ("rollout", "trainer")
"""Role kinds that run on GPUs when the job has them."""
_NO_GPUS = ("", "-1", "NoDevFiles")  # values of CUDA_VISIBLE_DEVICES that hide every GPU


class DeviceError(LayoutError):
    """A rank cannot get the device(s) its role needs; `field` names the config field to change
    (``layout.share_gpus``, ``layout.accelerator``, ...)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceBinding:
    """The device one rank uses."""

    rank: int
    """World rank."""
    role: str
    """Role kind (scheduler, env, rollout, trainer)."""
    device: str
    """torch device of the rank: 'cpu', or 'cuda:0' (its first GPU once CUDA_VISIBLE_DEVICES is narrowed)."""
    gpus: tuple[str, ...]
    """The GPUs the rank runs on, as the launcher names them (CUDA_VISIBLE_DEVICES entries: indices or UUIDs);
    empty on CPU. A rollout engine with tensor parallelism has several."""
    cuda_visible_devices: str | None
    """What CUDA_VISIBLE_DEVICES must be before CUDA starts; None: leave it as it is (nothing to hide)."""
    shared: bool = False
    """Another GPU rank of the node uses one of these GPUs too (only with layout.share_gpus)."""
    how: str = ""
    """Which rule decided, for the job log."""

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")

    def describe(self) -> str:
        where = f"GPU {','.join(self.gpus)} as {self.device}" if self.is_cuda else "CPU"
        return f"rank {self.rank} ({self.role}): {where}{' (shared)' if self.shared else ''} [{self.how}]"


def gpus_needed(role: str, layout: JobLayout) -> int:
    """GPUs a rank of this role needs on a GPU job: an engine its tensor-parallel size, a trainer rank one."""
    if role == "rollout":
        return max(1, layout.rollout.gpus_per_task)
    return 1 if role == "trainer" else 0


def bind_device(environ: Mapping[str, str], rank: int, layout: JobLayout, *, driver_gpus: int,
                node_ranks: Sequence[int] | None = None) -> DeviceBinding:
    """The device of world rank `rank` (pure). `environ`: the rank's environment; `driver_gpus`: NVIDIA GPUs
    the driver lists on its node (`count_driver_gpus()`); `node_ranks`: the world ranks on its node (None:
    from the launcher's variables). Raises DeviceError with the field to change."""
    role = assign_role(rank, layout).kind
    visible, source = visible_gpus(environ, driver_gpus)
    hide = "" if visible else None
    if role not in GPU_ROLES or layout.accelerator == "cpu":
        return DeviceBinding(rank=rank, role=role, device="cpu", gpus=(), cuda_visible_devices=hide,
                             how="CPU role" if role not in GPU_ROLES else "layout.accelerator is 'cpu'")
    if not visible or driver_gpus == 0:
        return _without_gpus(rank, role, layout, visible, source, hide, driver_gpus)
    need = gpus_needed(role, layout)
    node = sorted(node_ranks) if node_ranks is not None else node_ranks_from_env(environ)
    if rank not in node:
        raise ValueError(f"rank {rank} is not among its node's ranks {node}")
    if _bound_per_task(environ, visible):
        return _own_gpus(rank, role, need, visible, source)
    return _node_pool(rank, role, layout, node, visible, source)


def _without_gpus(rank, role, layout, visible, source, hide, driver_gpus) -> DeviceBinding:
    if layout.accelerator == "cuda":
        why = ("the driver lists no NVIDIA GPU on this node" if visible and driver_gpus == 0
               else f"it sees no GPU ({source})")
        raise DeviceError("layout.accelerator", f"is 'cuda' but rank {rank} ({role}) cannot use a GPU: {why}")
    how = "no GPU visible" if not visible else f"{source} names GPUs but the driver lists none"
    return DeviceBinding(rank=rank, role=role, device="cpu", gpus=(), cuda_visible_devices=hide,
                         how=f"layout.accelerator 'auto': {how}")


def _bound_per_task(environ: Mapping[str, str], visible: tuple[str, ...]) -> bool:
    """An srun step narrowed this task's view: it sees fewer GPUs than the node holds for the job."""
    on_node = environ.get("SLURM_GPUS_ON_NODE", "")
    return _launcher(environ) == "srun" and on_node.isdigit() and int(on_node) > len(visible)


def _own_gpus(rank, role, need, visible, source) -> DeviceBinding:
    if len(visible) < need:
        field = f"layout.{role}.gpus_per_task"
        raise DeviceError(field, f"rank {rank} ({role}) needs {need} GPU(s) but Slurm bound it to {len(visible)} "
                                 f"({source}={','.join(visible)}): submit the component with --gpus-per-task={need}")
    mine = visible[:need]
    return DeviceBinding(rank=rank, role=role, device="cuda:0", gpus=mine, cuda_visible_devices=",".join(mine),
                         how=f"Slurm per-task binding ({source})")


def _node_pool(rank, role, layout, node, visible, source) -> DeviceBinding:
    """Consecutive slices of the node's GPUs in world-rank order; with share_gpus, trainers from the front and
    engines from the back."""
    users = [(r, assign_role(r, layout).kind) for r in node]
    users = [(r, kind, gpus_needed(kind, layout)) for r, kind in users if kind in GPU_ROLES]
    total = sum(n for _, _, n in users)
    if total <= len(visible):
        offset = sum(n for r, _, n in users if r < rank)
        mine = visible[offset: offset + gpus_needed(role, layout)]
        return DeviceBinding(rank=rank, role=role, device="cuda:0", gpus=mine,
                             cuda_visible_devices=",".join(mine), how=f"node pool of {len(visible)} ({source})")
    if not layout.share_gpus:
        counts = ", ".join(f"{sum(1 for _, k, _ in users if k == kind)} {kind}" for kind in GPU_ROLES)
        raise DeviceError("layout.share_gpus",
                          f"rank {rank}'s node runs {counts} rank(s) needing {total} GPUs but {len(visible)} are "
                          f"visible ({source}={','.join(visible)}); give the job more GPUs or fewer ranks per node, "
                          "or set layout.share_gpus: true to let rollout and trainer ranks share")
    return _shared_pool(rank, role, users, visible, source)


def _shared_pool(rank, role, users, visible, source) -> DeviceBinding:
    slices: dict[int, tuple[str, ...]] = {}
    for kind in GPU_ROLES:
        mine = [(r, n) for r, k, n in users if k == kind]
        if sum(n for _, n in mine) > len(visible):  # NCCL refuses two ranks of one group on one GPU
            raise DeviceError("layout.trainer_tp" if kind == "trainer" else "layout.rollout_ranks",
                              f"even with layout.share_gpus, the {kind} ranks of rank {rank}'s node need "
                              f"{sum(n for _, n in mine)} GPUs of their own but {len(visible)} are visible "
                              f"({source}={','.join(visible)}): give the job more GPUs or fewer {kind} ranks per node")
        offset = 0
        for r, n in mine:
            start = offset if kind == "trainer" else len(visible) - offset - n
            slices[r] = visible[start: start + n]
            offset += n
    mine = slices[rank]
    shared = any(set(mine) & set(gpus) for r, gpus in slices.items() if r != rank)
    return DeviceBinding(rank=rank, role=role, device="cuda:0", gpus=mine, cuda_visible_devices=",".join(mine),
                         shared=shared, how=f"node pool of {len(visible)} shared by rollout and trainer "
                                            f"(layout.share_gpus; {source})")


# ------------------------------------------------------------------------------------------ environment
def visible_gpus(environ: Mapping[str, str], driver_gpus: int) -> tuple[tuple[str, ...], str]:
    """The GPUs this process may use and where that came from."""
    for name in ("CUDA_VISIBLE_DEVICES", "SLURM_STEP_GPUS", "SLURM_JOB_GPUS"):
        value = environ.get(name)
        if value is None or (name != "CUDA_VISIBLE_DEVICES" and not value.strip()):
            continue
        if value.strip() in _NO_GPUS:
            return (), name
        ids = tuple(part.strip() for part in value.split(","))
        if "" in ids or len(set(ids)) != len(ids):
            raise DeviceError("layout.accelerator", f"{name}={value!r} is not a list of distinct GPU ids")
        return ids, name
    return tuple(str(i) for i in range(driver_gpus)), "the driver"


def _launcher(environ: Mapping[str, str]) -> str:
    # mpirun inside an allocation also leaves SLURM_* variables (of its daemons' step): MPI's own come first
    if "OMPI_COMM_WORLD_LOCAL_RANK" in environ:
        return "openmpi"
    if "MPI_LOCALRANKID" in environ and "PMI_RANK" in environ:
        return "mpich"
    if "SLURM_GTIDS" in environ and "SLURM_STEP_ID" in environ:
        return "srun"
    return "single"


_RANK_VARIABLES = {"openmpi": ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
                   "mpich": ("PMI_RANK", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"), "srun": ("SLURM_PROCID", "SLURM_GTIDS"),
                   "single": ()}
"""Per launcher, the variables that give a rank's world rank and the ranks sharing its node."""


def world_rank_from_env(environ: Mapping[str, str]) -> int:
    """This rank's world rank, from the launcher's variables (0 for a process started alone)."""
    launcher = _launcher(environ)
    return int(environ[_RANK_VARIABLES[launcher][0]]) if launcher != "single" else 0


def node_ranks_from_env(environ: Mapping[str, str]) -> list[int]:
    """World ranks on this rank's node, from the launcher's variables."""
    launcher = _launcher(environ)
    if launcher == "srun":
        return sorted(int(r) for r in environ["SLURM_GTIDS"].split(","))
    if launcher == "single":
        return [0]
    rank, local, size = (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE")
                         if launcher == "openmpi" else ("PMI_RANK", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"))
    first = int(environ[rank]) - int(environ[local])
    return list(range(first, first + int(environ[size])))


_GPU_DIR = re.compile(r"^nvidia(\d+)$")


def count_driver_gpus(proc_dir: str = "/proc/driver/nvidia/gpus", dev_dir: str = "/dev") -> int:
    """NVIDIA GPUs on this node, without starting CUDA (which would freeze CUDA_VISIBLE_DEVICES): the
    driver's /proc entries, else the /dev/nvidiaN device files. 0 on a machine without the driver."""
    proc = Path(proc_dir)
    if proc.is_dir():
        return sum(1 for _ in proc.iterdir())
    dev = Path(dev_dir)
    return sum(1 for p in dev.iterdir() if _GPU_DIR.match(p.name)) if dev.is_dir() else 0


def placement_mismatch(environ: Mapping[str, str], layout: JobLayout, driver_gpus: int,
                       applied: DeviceBinding, rank: int, node_ranks: Sequence[int]) -> str | None:
    """After MPI_Init: why the binding `applied` before it (from the launcher's variables in `environ`, as they
    were then) is not the one MPI's placement gives (world `rank`, `node_ranks` from a shared-memory split), or
    None when it is. Node lists that differ without changing this rank's binding are no error."""
    try:
        expected: DeviceBinding | str = bind_device(environ, rank, layout, driver_gpus=driver_gpus,
                                                    node_ranks=node_ranks)
    except (LayoutError, ValueError) as exc:
        expected = f"refused ({exc})"
    if expected == applied:
        return None
    launcher = _launcher(environ)
    names = "/".join(_RANK_VARIABLES[launcher]) or "no launcher variables"
    should = expected if isinstance(expected, str) else expected.describe()
    return (f"rank {rank}: its device was chosen before MPI_Init from the launcher's variables ({names}: world rank "
            f"{world_rank_from_env(environ)}, node ranks {node_ranks_from_env(environ)}), but MPI places it as world "
            f"rank {rank} among node ranks {sorted(node_ranks)}: it would run as {applied.describe()} instead of "
            f"{should}. Start the ranks in blocks of consecutive world ranks per node (mpirun's default --map-by "
            "slot, srun's default block distribution; not --map-by node or srun -m cyclic)")


def joiner_gpus(visible: Sequence[str], held: Mapping[int, Sequence[str]], need: int,
                replaces: Sequence[str] = ()) -> tuple[str, ...]:
    """The GPUs of a rollout rank that joins a live job in local mode (pure): a replacement takes the GPUs of the
    rank it replaces; any other joiner the first `need` of the node's `visible` GPUs that no live rank holds
    (`held`: live rank -> its GPUs). Without this a joiner took cuda:0, which another rank holds: vLLM refused to
    start, or two ranks shared one GPU and every channel fell back to gloo. Raises DeviceError when none are free."""
    taken = {gpu for gpus in held.values() for gpu in gpus}
    if replaces and len(replaces) == need and not taken & set(replaces):
        return tuple(replaces)
    free = [gpu for gpu in visible if gpu not in taken]
    if len(free) < need:
        raise DeviceError("layout.rollout.gpus_per_task", f"no free GPU for a joining rollout rank: it needs {need}, "
                                                           f"the node's {len(visible)} are held by the live ranks")
    return tuple(free[:need])


def joined_binding(rank: int, gpus: Sequence[str]) -> DeviceBinding:
    """The binding of a rank that joined in local mode on the GPUs rank 0 gave it (`joiner_gpus`)."""
    if not gpus:
        return DeviceBinding(rank=rank, role="rollout", device="cpu", gpus=(), cuda_visible_devices=None,
                             how="joined on the CPU")
    return DeviceBinding(rank=rank, role="rollout", device="cuda:0", gpus=tuple(gpus),
                         cuda_visible_devices=",".join(gpus), how="joined: the GPUs rank 0 gave it")


def cuda_environment(binding: DeviceBinding) -> dict[str, str]:
    """CUDA settings a rank needs before CUDA starts, besides its GPUs. A trainer rank on a GPU runs with one
    hardware queue per device (CUDA_DEVICE_MAX_CONNECTIONS=1): megatron overlaps its TP all-reduces with compute
    and relies on kernels starting in the order they were launched."""
    return {"CUDA_DEVICE_MAX_CONNECTIONS": "1"} if binding.role == "trainer" and binding.is_cuda else {}


def apply_binding(binding: DeviceBinding, environ: MutableMapping[str, str] = os.environ) -> None:
    """Narrows CUDA_VISIBLE_DEVICES to the rank's GPUs (hides them from a CPU rank), sets what else CUDA must know
    before it starts (`cuda_environment`; a site's own value is kept) and, on a GPU, makes its first one torch's
    current device. Must run before anything in the process starts CUDA, MPI_Init included."""
    if binding.cuda_visible_devices is not None:
        environ["CUDA_VISIBLE_DEVICES"] = binding.cuda_visible_devices
    for name, value in cuda_environment(binding).items():
        environ.setdefault(name, value)
    if not binding.is_cuda:
        return
    import torch

    if torch.version.cuda is None and torch.version.hip is None:
        raise DeviceError("layout.accelerator", f"rank {binding.rank} ({binding.role}) was given GPU(s) "
                                                f"{','.join(binding.gpus)} but this torch build has no CUDA "
                                                f"(torch {torch.__version__}): install a CUDA build of torch, or set "
                                                "layout.accelerator: cpu")
    count = torch.cuda.device_count()
    if count != len(binding.gpus):
        raise RuntimeError(f"rank {binding.rank}: CUDA sees {count} device(s) after CUDA_VISIBLE_DEVICES="
                           f"{binding.cuda_visible_devices!r}: CUDA was started before the device binding")
    torch.cuda.set_device(0)
    bind_cpus_near([pci_address(torch.cuda.get_device_properties(i)) for i in range(count)])


# ------------------------------------------------------------------------------------------ CPUs near the GPUs
def pci_address(properties) -> str:
    """The sysfs name of a CUDA device's PCI function ('0000:8a:00.0'), from torch's device properties."""
    return f"{properties.pci_domain_id:04x}:{properties.pci_bus_id:02x}:{properties.pci_device_id:02x}.0"


def parse_cpulist(text: str) -> set[int]:
    """The kernel's CPU list format: '0-3,8-11' -> {0, 1, 2, 3, 8, 9, 10, 11}."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if part:
            low, _, high = part.partition("-")
            cpus.update(range(int(low), int(high or low) + 1))
    return cpus


def gpu_local_cpus(addresses: Sequence[str], sysfs: str | Path = "/sys/bus/pci/devices") -> set[int] | None:
    """The CPUs local to any of these PCI devices (the kernel's `local_cpulist`); None when one is not listed."""
    cpus: set[int] = set()
    for address in addresses:
        path = Path(sysfs) / address.lower() / "local_cpulist"
        if not path.is_file():
            return None
        cpus |= parse_cpulist(path.read_text())
    return cpus


def cpus_near(allowed: set[int], local: set[int] | None) -> set[int] | None:
    """The CPUs a GPU rank narrows to: those near its GPUs among those it may use; None to keep its affinity
    (nothing known, nothing in common, or nothing to narrow)."""
    if not local:
        return None
    chosen = allowed & local
    return chosen if chosen and chosen != allowed else None


def bind_cpus_near(addresses: Sequence[str], sysfs: str | Path = "/sys/bus/pci/devices") -> set[int] | None:
    """Narrows this process's CPU affinity to the CPUs near its GPUs (`cpus_near`); returns the new set, or None
    when it kept its affinity. Threads and processes started later inherit it (vLLM's workers, torch's pools)."""
    chosen = cpus_near(os.sched_getaffinity(0), gpu_local_cpus(addresses, sysfs))
    if chosen is not None:
        os.sched_setaffinity(0, chosen)
    return chosen
