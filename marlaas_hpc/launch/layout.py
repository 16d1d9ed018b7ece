"""Job layout: which MPI ranks play which role, and what each Slurm het component asks for.

World (one MPI_COMM_WORLD, docs/architecture.md §2), components in this order::

    rank 0                       | 1 .. E          | E+1 .. E+R       | E+R+1 .. E+R+G*DP*TP
    control (scheduler + intake) | env (CPU)       | rollout (GPU)    | trainer (GPU): G groups of DP*TP ranks,
    het group 0                  | het group 1     | het group 2      |   TP-major inside a group: trainer i ->
                                                                      |   group i // (DP*TP), j = i % (DP*TP),
                                                                      |   tp_rank j % TP, dp_rank j // TP
                                                                      | het group 3

A trainer group (DP x TP ranks, its own torch.distributed world) owns a set of tasks; groups never exchange
gradients. With G = 1 (the default) the trainer component is one group, as before.

`assign_role(rank, layout)` is pure; the same function is used under `mpirun -np N` (local mode) and
under `srun --het-group=0-3` (Slurm), where the component of a rank can also be read from the Slurm
environment (see `slurm_env.py`) and must agree.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

from marlaas_hpc.config_loader import SpecError, bounded, check_bounds, fields_under, load_config

COMPONENTS = ("control", "env", "rollout", "trainer")
"""Het-group order; index = Slurm het group = position in the MPI world."""
ROLE_KINDS = ("scheduler", "env", "rollout", "trainer")
"""Role kind of the ranks of each component (control ranks run the scheduler)."""
CPU_ONLY_COMPONENTS = ("control", "env")
MPI_PLUGINS = ("pmix", "pmi2", "ulfm")
EMULATED_NODES_ENV = "MARLAAS_EMULATED_NODES"
"""Set to 1 under `emulated_nodes` with `mpi: ulfm`: launch/ulfm_slurm.py gives each daemon its node's name."""
JOIN_WEIGHTS = ("peer", "disk")
"""Where a joining rollout rank reads the base weights (`JobLayout.join_weights`)."""

_MEM = re.compile(r"^[1-9][0-9]*[KMGT]?$")
_TIME = re.compile(r"^(?:(?P<d>\d+)-(?P<dh>\d+)(?::(?P<dm>\d+)(?::(?P<ds>\d+))?)?"
                   r"|(?P<a>\d+)(?::(?P<b>\d+)(?::(?P<c>\d+))?)?)$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_GPU_OPTIONS = ("--gpus", "--gres=gpu", "--gpus-per-node", "--gpus-per-task", "--gpus-per-socket", "-G")


class LayoutError(SpecError):
    """A layout field is invalid; `field` is its dotted path, e.g. ``trainer.gpus_per_task``."""


def parse_slurm_time(value: str | int) -> int:
    """Seconds of a Slurm time limit: an int is minutes; strings as sbatch --time accepts them
    (M, M:S, H:M:S, D-H, D-H:M, D-H:M:S)."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value <= 0:
            raise ValueError(f"time must be > 0 minutes, got {value}")
        return value * 60
    match = _TIME.match(str(value).strip())
    if not match:
        raise ValueError(f"{value!r} is not a Slurm time (M, M:S, H:M:S, D-H, D-H:M or D-H:M:S)")
    g = {k: int(v) for k, v in match.groupdict().items() if v is not None}
    if "d" in g:
        seconds = ((g["d"] * 24 + g["dh"]) * 60 + g.get("dm", 0)) * 60 + g.get("ds", 0)
    elif "c" in g:
        seconds = (g["a"] * 60 + g["b"]) * 60 + g["c"]
    else:
        seconds = g["a"] * 60 + g.get("b", 0)
    if seconds <= 0:
        raise ValueError(f"time {value!r} must be > 0")
    return seconds


GPU_MEMORY_GIB = {"h100-80gb": 79.6, "h200": 139.0, "a100-80gb": 79.1, "a100-40gb": 39.4, "l40s": 44.4,
                  "b200": 178.4}
"""What CUDA reports of each GPU model's memory, in GiB (torch.cuda.get_device_properties().total_memory,
rounded down): less than the name says (an 80 GB H100 reports about 79.6 GiB)."""
DEFAULT_GPU_TYPE = "h100-80gb"


@dataclass(kw_only=True)
class ComponentResources:
    """What one het component asks Slurm for (one `#SBATCH` block)."""

    nodes: int = bounded(1, ge=1)
    """Nodes of this component (het components never share a node)."""
    ntasks: int | None = bounded(None, ge=0)
    """MPI ranks of this component. None: derived from the layout (control 1, env `env_ranks`, rollout
    `rollout_ranks`, trainer `trainer_groups * trainer_dp * trainer_tp`); when given it must equal that number."""
    cpus_per_task: int = bounded(1, ge=1)
    """CPU cores per rank (--cpus-per-task, in the component's block and in its part of the srun step)."""
    gpus_per_task: int = bounded(0, ge=0)
    """GPUs per rank (--gpus-per-task); only rollout and trainer may ask for GPUs. Rollout: the GPUs of one
    engine (= vllm.tensor_parallel_size when above 1); trainer: at most 1 (one GPU per TP rank; with trainer_tp
    above 1 rendered per node, --gpus-per-node, so that the node's TP ranks keep NVLink: launch/sbatch.py). Also
    read in local mode (mpirun) to size each rollout rank's share of the node's GPUs (launch/devices.py)."""
    mem: str | None = None
    """Memory per node as sbatch --mem takes it, e.g. '64G'; None: the partition default."""
    partition: str | None = None
    """Slurm partition; None: the cluster's default partition."""
    time: str | int | None = None
    """Wall-clock limit of this component (int minutes or 'H:M:S', 'D-H:M:S', ...); None: JobLayout.time."""
    account: str | None = None
    """--account charged for this component."""
    qos: str | None = None
    """--qos of this component."""
    constraint: str | None = None
    """--constraint (node features), e.g. 'h100&ib'."""
    extra_sbatch: list[str] = field(default_factory=list)
    """More sbatch options for this component, verbatim in long form, e.g. ['--exclusive', '--reservation=rl']."""
    gpu_type: str | None = None
    """The GPU model of this component's nodes, one of GPU_MEMORY_GIB's names ('h100-80gb', 'h200', 'a100-80gb',
    ...): what `gpu_memory_gib` defaults to. None: an 80 GB H100."""
    gpu_memory_gib: float | None = bounded(None, gt=0, le=4096, unit="GiB")
    """Memory of each of this component's GPUs as CUDA reports it, in GiB (a site's own figure); None: what
    `gpu_type` reports (GPU_MEMORY_GIB). Rollout and trainer only: `marlaas plan` checks each rank's estimated
    device memory against it, and `marlaas run` / `submit` refuse a job whose GPU ranks would not fit
    (marlaas_hpc/plan)."""

    @property
    def gpu_gib(self) -> float:
        """The memory of one GPU the plan counts with: `gpu_memory_gib`, else its `gpu_type`'s."""
        if self.gpu_memory_gib is not None:
            return self.gpu_memory_gib
        return GPU_MEMORY_GIB[self.gpu_type or DEFAULT_GPU_TYPE]

    def validate(self, name: str) -> None:
        check_bounds(self, name, LayoutError)  # each field's bounds, beside it above
        if self.gpu_type is not None and self.gpu_type not in GPU_MEMORY_GIB:
            raise LayoutError(f"{name}.gpu_type", f"unknown GPU {self.gpu_type!r}; known: {sorted(GPU_MEMORY_GIB)} "
                                                  "(or give gpu_memory_gib)")
        if self.mem is not None and not (isinstance(self.mem, str) and _MEM.match(self.mem)):
            raise LayoutError(f"{name}.mem", f"{self.mem!r} is not a size like '4000', '16G' or '512M'")
        if self.time is not None:
            try:
                parse_slurm_time(self.time)
            except ValueError as exc:
                raise LayoutError(f"{name}.time", str(exc)) from None
        for key in ("partition", "account", "qos", "constraint"):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, str) or not value or any(c.isspace() for c in value)):
                raise LayoutError(f"{name}.{key}", f"must be a non-empty word without spaces, got {value!r}")
        for i, option in enumerate(self.extra_sbatch):
            if not isinstance(option, str) or not option.startswith("--") or "\n" in option:
                raise LayoutError(f"{name}.extra_sbatch[{i}]",
                                  f"must be one long sbatch option like '--exclusive' or '--key=value', got {option!r}")
            if option.split("=", 1)[0] in ("--hetjob", "--het-group", "--job-name", "--output", "--error"):
                raise LayoutError(f"{name}.extra_sbatch[{i}]", f"{option!r} is set by the launcher itself")

    def requests_gpus(self) -> bool:
        return self.gpus_per_task > 0 or any(o.split("=", 1)[0] in _GPU_OPTIONS or o.startswith("--gres=gpu")
                                             for o in self.extra_sbatch)


@dataclass(kw_only=True)
class JobLayout:
    """The shape of one job: ranks per role, and one het component per role group."""

    env_ranks: int = 1
    """Env ranks (CPU: tools, multi-turn, rewards)."""
    rollout_ranks: int = 1
    """Rollout ranks, one vLLM engine each."""
    trainer_tp: int = bounded(1, ge=1)
    """Tensor-parallel size of the trainer (a TP group should sit inside one node)."""
    trainer_dp: int = bounded(1, ge=1)
    """Data-parallel replicas inside each trainer group: a task's batch is split over them and its LoRA
    gradients are all-reduced over the DP group."""
    trainer_ep: int = bounded(1, ge=1)
    """Expert parallelism of a mixture-of-experts model (trainer/experts_parallel.py): each MoE layer's experts, their
    LoRA and its optimizer state are split over `trainer_ep` of a group's DP ranks, and tokens travel to their
    experts' rank (all-to-all). Must divide trainer_dp and the model's experts; trainer_tp 1 only (EP with TP is not
    built). 1: every rank holds every expert."""
    trainer_groups: int = bounded(1, ge=1)
    """Independent trainer groups (each trainer_dp x trainer_tp ranks, its own megatron world). Every task is
    owned by one group (its adapter shards and optimizer live there); the scheduler places each new task on
    the least-loaded group by tokens per step. Trainer ranks = trainer_groups * trainer_dp * trainer_tp."""
    trainer_group_models: list[str] = field(default_factory=list)
    """The base model each trainer group loads, one name of the job's `models` per group (e.g. [tiny, chat] with
    trainer_groups: 2); a task goes only to a group of its `base_model`. Empty: every group loads the job's first
    model (the only one a job of one model has)."""
    control: ComponentResources = field(default_factory=ComponentResources)
    """Het group 0: rank 0 (scheduler + intake), exactly one task, CPU only."""
    env: ComponentResources = field(default_factory=ComponentResources)
    """Het group 1: env ranks, CPU only."""
    rollout: ComponentResources = field(default_factory=ComponentResources)
    """Het group 2: rollout ranks (GPU partition on a cluster)."""
    trainer: ComponentResources = field(default_factory=ComponentResources)
    """Het group 3: trainer ranks (GPU partition on a cluster)."""
    accelerator: Literal["auto", "cpu", "cuda"] = bounded("auto", choices=("auto", "cpu", "cuda"))
    """Devices of rollout and trainer ranks (launch/devices.py): 'auto' runs them on GPUs where the driver lists
    GPUs and the rank is given some, else on the CPU; 'cuda' refuses to start a rollout or trainer rank without
    its GPU(s); 'cpu' never uses GPUs. Scheduler and env ranks always run on the CPU."""
    rollout_replace: bool = bounded(False)
    """A lost rollout rank is replaced by a new one that joins the live job (on the fault-tolerant MPI:
    runtime/scaling.py); its groups go to the survivors meanwhile. Under Slurm (`mpi: ulfm`) the replacement runs on
    the dead rank's node with its GPU(s), once per job; under plain srun it is not replaced."""
    join_weights: str = bounded("disk", choices=JOIN_WEIGHTS)
    """Where a rollout rank that joins the live job (`marlaas scale`, `rollout_replace`) reads the base model's
    files: 'disk' (the model directory) or 'peer' (from a live rollout rank over MPI, chunked and pipelined;
    joiners started together form a chain, each link carrying the model once; runtime/peer_weights.py; a peer
    lost mid-transfer falls back to the disk). 'peer' is for a shared filesystem that a burst of starting ranks
    contends for (λScale); it needs node-local tmp space ($TMPDIR) for one copy of the model per joined rank, and
    on one machine, where the disk is the page cache, it was no faster (tools/bench_join_weights.py): hence not
    the default. One base model only."""
    share_gpus: bool = bounded(False)
    """Let rollout and trainer ranks on one node share GPUs when the node has fewer GPUs than they need (e.g. one
    vLLM engine and a TP=1 trainer on a one-GPU machine). Without it such a node is refused. Trainer ranks among
    themselves and engines among themselves still get distinct GPUs; leave room for the trainer with
    vllm.gpu_memory_utilization."""
    time: str | int = "01:00:00"
    """Default wall-clock limit of every component without its own `time`."""
    mpi: Literal["pmix", "pmi2", "ulfm"] = "pmix"
    """How a Slurm job's ranks start. 'pmix' / 'pmi2': one srun step with that --mpi plugin (it must match the MPI
    library mpi4py was built against: `srun --mpi=list`); any rank's death ends the step and the job. 'ulfm': the
    fault-tolerant Open MPI 5 that tools/setup_env.sh installs under the venv starts them with its own mpiexec, its
    daemons through srun (launch/ulfm_slurm.py): a lost env or rollout rank stops no tenant (fault.on_rank_loss)."""
    signal_lead_s: int = 120
    """Slurm sends USR2 this many seconds before the time limit (--signal=USR2@N): time to checkpoint."""
    srun_grace_s: int = 60
    """Seconds srun may outlive its finished step before the batch script stops it (launch/step_guard.py:
    some Slurm versions leave srun of a het step hanging after every rank exited)."""
    network_interface: str | None = None
    """NIC for MPI/NCCL/gloo TCP traffic (OMPI_MCA_*_if_include, NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME),
    e.g. 'ib0'; None: let each library choose."""
    emulated_nodes: bool = bounded(False)
    """Several emulated slurmd on one machine (slurm/local-cluster): exports the Open MPI settings that a
    step spanning them needs (ob1 + tcp over lo; the shared-memory transport segfaults otherwise); with
    `mpi: ulfm`, MARLAAS_EMULATED_NODES=1 instead (each daemon runs under its node's name: launch/ulfm_slurm.py)."""
    setup: list[str] = field(default_factory=list)
    """Shell lines run by the batch script before srun, e.g. 'module load openmpi/4.1'."""
    exports: dict[str, str] = field(default_factory=dict)
    """Environment variables exported by the batch script for every rank (after the launcher's own)."""

    # -- derived ----------------------------------------------------------------------------------------
    @property
    def trainer_group_size(self) -> int:
        """Ranks of one trainer group: DP x TP."""
        return self.trainer_tp * self.trainer_dp

    @property
    def trainer_ranks(self) -> int:
        return self.trainer_groups * self.trainer_group_size

    @property
    def component_sizes(self) -> tuple[int, int, int, int]:
        """Ranks per het component, in COMPONENTS order."""
        return (1, self.env_ranks, self.rollout_ranks, self.trainer_ranks)

    @property
    def world_size(self) -> int:
        return sum(self.component_sizes)

    def resources(self, component: int | str) -> ComponentResources:
        name = component if isinstance(component, str) else COMPONENTS[component]
        return getattr(self, name)

    def component_time(self, component: int | str) -> str | int:
        own = self.resources(component).time
        return self.time if own is None else own

    def exports_for_job(self) -> dict[str, str]:
        """Environment the batch script exports before srun: emulated-node and NIC settings, then `exports`."""
        out: dict[str, str] = {}
        ulfm_emulated = self.emulated_nodes and self.mpi == "ulfm"
        if ulfm_emulated:  # Open MPI 5 tells nodes apart by name: each daemon gets its own (launch/ulfm_slurm.py)
            out[EMULATED_NODES_ENV] = "1"
        elif self.emulated_nodes:  # Open MPI's shared-memory btl segfaults across emulated nodes
            out.update(OMPI_MCA_pml="ob1", OMPI_MCA_btl="self,tcp")
        nic = "lo" if self.emulated_nodes else self.network_interface
        if nic and not ulfm_emulated:  # PRRTE found no interface for its daemons with oob over lo
            out.update(OMPI_MCA_btl_tcp_if_include=nic, OMPI_MCA_oob_tcp_if_include=nic)
        if nic:
            out.update(NCCL_SOCKET_IFNAME=nic, GLOO_SOCKET_IFNAME=nic)
        out.update(self.exports)
        return out

    # -- validation -------------------------------------------------------------------------------------
    def validate(self, prefix: str = "") -> "JobLayout":
        """Checks every field; errors name it under `prefix` (the layout's place in its file, e.g. 'layout')."""
        with fields_under(prefix):
            self._validate()
        return self

    def _validate(self) -> None:
        _int_at_least(self.env_ranks, 1, "env_ranks", "a job needs at least one env rank to score rollouts")
        _int_at_least(self.rollout_ranks, 1, "rollout_ranks", "a job needs at least one rollout rank to generate")
        check_bounds(self, "", LayoutError)  # each field's bounds, beside it above
        models = self.trainer_group_models
        if not isinstance(models, list) or not all(isinstance(m, str) and m for m in models):
            raise LayoutError("trainer_group_models", f"must be a list of model names, got {models!r}")
        if models and len(models) != self.trainer_groups:
            raise LayoutError("trainer_group_models", f"names {len(models)} models for {self.trainer_groups} "
                                                      "trainer groups: one per group")
        for name, expected in zip(COMPONENTS, self.component_sizes):
            self._validate_component(name, expected)
        try:
            parse_slurm_time(self.time)
        except ValueError as exc:
            raise LayoutError("time", str(exc)) from None
        if self.mpi not in MPI_PLUGINS:
            raise LayoutError("mpi", f"unknown MPI start {self.mpi!r}; use one of {list(MPI_PLUGINS)}")
        _int_at_least(self.signal_lead_s, 0, "signal_lead_s")
        if self.trainer_ep > 1 and self.trainer_tp > 1:
            raise LayoutError("trainer_ep", f"> 1 runs at trainer_tp 1 only (expert parallelism with tensor "
                                            f"parallelism is not built), got trainer_tp={self.trainer_tp}")
        if self.trainer_dp % self.trainer_ep:
            raise LayoutError("trainer_ep", f"must divide trainer_dp={self.trainer_dp} (the EP ranks are a group's DP "
                                            f"ranks), got {self.trainer_ep}")
        _int_at_least(self.srun_grace_s, 1, "srun_grace_s")
        if self.emulated_nodes and self.network_interface not in (None, "lo"):
            raise LayoutError("network_interface", "emulated nodes talk over 'lo'; leave network_interface unset")
        for i, line in enumerate(self.setup):
            if not isinstance(line, str) or "\n" in line:
                raise LayoutError(f"setup[{i}]", f"must be one shell line, got {line!r}")
        for key, value in self.exports.items():
            if not isinstance(key, str) or not _ENV_NAME.match(key):
                raise LayoutError(f"exports.{key}", "is not a valid environment variable name")
            if not isinstance(value, str):
                raise LayoutError(f"exports.{key}", f"must be a string, got {value!r}")

    def _validate_component(self, name: str, expected: int) -> None:
        res: ComponentResources = getattr(self, name)
        if not isinstance(res, ComponentResources):
            raise LayoutError(name, f"must be a ComponentResources, got {type(res).__name__}")
        res.validate(name)
        ntasks = expected if res.ntasks is None else res.ntasks
        if ntasks == 0:
            raise LayoutError(f"{name}.ntasks", "a component needs at least one task")
        if name == "trainer" and ntasks % self.trainer_tp:
            raise LayoutError("trainer.ntasks", f"{ntasks} trainer tasks are not a multiple of trainer_tp="
                                                f"{self.trainer_tp}")
        if ntasks != expected:
            why = {"control": "rank 0 alone runs the scheduler",
                   "env": f"env_ranks={self.env_ranks}", "rollout": f"rollout_ranks={self.rollout_ranks}",
                   "trainer": f"trainer_groups * trainer_dp * trainer_tp = {self.trainer_groups} * "
                              f"{self.trainer_dp} * {self.trainer_tp}"}[name]
            raise LayoutError(f"{name}.ntasks", f"is {ntasks} but must be {expected} ({why}); leave it unset "
                                                "to derive it")
        if res.nodes > ntasks:
            raise LayoutError(f"{name}.nodes", f"{res.nodes} nodes for {ntasks} task(s): a node would stay empty")
        if name == "trainer" and res.gpus_per_task > 1:
            raise LayoutError("trainer.gpus_per_task", f"is {res.gpus_per_task}, but a trainer rank drives one GPU "
                                                       "(its TP group is one rank per GPU): use trainer_tp for more")
        if name in CPU_ONLY_COMPONENTS and res.requests_gpus():
            raise LayoutError(f"{name}.gpus_per_task" if res.gpus_per_task else f"{name}.extra_sbatch",
                              f"the {name} component is CPU-only; ask for GPUs on rollout or trainer")
        if name == "trainer" and res.nodes > 1:
            per_node, rest = divmod(ntasks, res.nodes)
            if rest or per_node % self.trainer_tp:
                raise LayoutError("trainer.nodes", f"{ntasks} trainer ranks on {res.nodes} nodes split a TP group "
                                                   f"(trainer_tp={self.trainer_tp}) across nodes; use a node count "
                                                   f"that gives each node a multiple of {self.trainer_tp} ranks")

    # -- plain data (YAML) ------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> "JobLayout":
        """Builds and validates a layout from plain data; unknown or mistyped fields name themselves."""
        return load_config(cls, data, error=LayoutError, root="layout")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------------------------------------- roles
@dataclass(frozen=True, kw_only=True, slots=True)
class Role:
    """What one world rank does."""

    kind: Literal["scheduler", "env", "rollout", "trainer"]
    """Role kind."""
    index: int
    """Index among the ranks of this kind (0-based): env_rank, rollout_rank, trainer index."""
    component: int
    """Het group / component index (COMPONENTS order)."""
    tp_rank: int | None = None
    """Trainers only: rank inside the TP group (TP groups are consecutive world ranks)."""
    dp_rank: int | None = None
    """Trainers only: which data-parallel replica inside its trainer group."""
    group: int | None = None
    """Trainers only: which trainer group (its own torch.distributed world of DP x TP ranks)."""


def assign_role(rank: int, layout: JobLayout) -> Role:
    """The role of world rank `rank` (pure; components are laid out in COMPONENTS order)."""
    if not isinstance(rank, int) or not 0 <= rank < layout.world_size:
        raise ValueError(f"rank {rank!r} is outside the world of {layout.world_size} ranks")
    start = 0
    for component, size in enumerate(layout.component_sizes):
        if rank < start + size:
            index = rank - start
            if ROLE_KINDS[component] == "trainer":
                group, inside = divmod(index, layout.trainer_group_size)
                return Role(kind="trainer", index=index, component=component, tp_rank=inside % layout.trainer_tp,
                            dp_rank=inside // layout.trainer_tp, group=group)
            return Role(kind=ROLE_KINDS[component], index=index, component=component)
        start += size
    raise AssertionError("unreachable")


def ranks_of(kind: str, layout: JobLayout) -> range:
    """World ranks of one role kind, e.g. ranks_of('rollout', layout)."""
    component = ROLE_KINDS.index(kind)
    start = sum(layout.component_sizes[:component])
    return range(start, start + layout.component_sizes[component])


def trainer_group_ranks(layout: JobLayout) -> list[list[int]]:
    """World ranks of each trainer group, in group order; a group's first rank is its leader (TP rank 0 of DP
    replica 0), and position j in every group is the same (tp_rank, dp_rank)."""
    trainers = list(ranks_of("trainer", layout))
    size = layout.trainer_group_size
    return [trainers[g * size:(g + 1) * size] for g in range(layout.trainer_groups)]


class WorldCheck(NamedTuple):
    """Result of `world_size_matches`; truthy when the sizes agree."""

    ok: bool
    message: str

    def __bool__(self) -> bool:
        return self.ok


def world_size_matches(layout: JobLayout, actual: int) -> WorldCheck:
    """Does the MPI world have the layout's size? The message says what is wrong and the likely cause."""
    want = layout.world_size
    parts = " + ".join(f"{n} {c}" for c, n in zip(COMPONENTS, layout.component_sizes))
    if actual == want:
        return WorldCheck(True, f"MPI world of {actual} ranks matches the layout ({parts})")
    message = f"MPI world has {actual} rank(s) but the layout needs {want} ({parts})."
    if actual == 1:
        message += (" Every process being a world of 1 usually means the launcher does not match the MPI "
                    "library (an mpiexec from another MPI, or srun without the right --mpi plugin): each "
                    "process started as a singleton.")
    else:
        message += " Start exactly that many ranks (mpirun -np / the het-group task counts)."
    return WorldCheck(False, message)


def require_world_size(layout: JobLayout, actual: int) -> None:
    """Raises RuntimeError with `world_size_matches`' message when the sizes differ."""
    check = world_size_matches(layout, actual)
    if not check:
        raise RuntimeError(check.message)


# ---------------------------------------------------------------------------------------------- helpers
def _int_at_least(value: Any, low: int, name: str, why: str = "") -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise LayoutError(name, f"must be an integer >= {low}, got {value!r}" + (f" ({why})" if why else ""))
