"""Where a rank sits in a Slurm (het) job step, from its environment alone (pure; no scontrol).

Inside `srun --het-group=0-3 ...` every task sees SLURM_PROCID (world rank), SLURM_NTASKS (world size),
SLURM_HET_SIZE and SLURM_NTASKS_HET_GROUP_<i>, SLURM_JOB_NODELIST_HET_GROUP_<i> — but no
SLURM_HET_JOB_COMPONENT, so the component comes from the running sums of the per-group task counts.
SLURM_JOB_ID is the het leader's id in every component (what submitit's file names use).
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from marlaas_hpc.launch.layout import COMPONENTS, JobLayout, assign_role


class SlurmEnvError(ValueError):
    """The environment is not a Slurm task's, or is inconsistent."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SlurmPlacement:
    """A task's place in its job step."""

    job_id: str
    """SLURM_JOB_ID (the het leader's id in every component of a het job)."""
    rank: int
    """World rank (SLURM_PROCID)."""
    world_size: int
    """Tasks in the step (SLURM_NTASKS / SLURM_STEP_NUM_TASKS)."""
    local_rank: int
    """Rank on this node (SLURM_LOCALID)."""
    component: int
    """Het component of this task (0 for a plain job)."""
    component_rank: int
    """Rank within the component."""
    component_sizes: tuple[int, ...]
    """Tasks per het component (one entry for a plain job)."""
    component_nodes: tuple[tuple[str, ...], ...]
    """Expanded node list per het component."""
    step_nodes: tuple[str, ...]
    """Expanded node list of the step (SLURM_STEP_NODELIST, else the job's)."""
    node_name: str | None
    """This task's node (SLURMD_NODENAME)."""
    restart_count: int
    """SLURM_RESTART_COUNT: how often the job was requeued."""

    @property
    def is_het(self) -> bool:
        return len(self.component_sizes) > 1

    @property
    def rendezvous_host(self) -> str:
        """torch.distributed MASTER_ADDR: the first host of the step node list (runs world rank 0)."""
        return self.step_nodes[0]

    def component_host(self, component: int) -> str:
        """First host of one component, e.g. the rendezvous of a group spanning only trainer ranks."""
        return self.component_nodes[component][0]

    def mismatch_with(self, layout: JobLayout) -> str | None:
        """None when the step has the layout's shape and this rank's component agrees with
        `assign_role`; otherwise a message saying what differs."""
        if self.is_het and self.component_sizes != layout.component_sizes:
            got = ", ".join(str(n) for n in self.component_sizes)
            want = ", ".join(f"{c}={n}" for c, n in zip(COMPONENTS, layout.component_sizes))
            return f"Slurm het-group task counts ({got}) differ from the layout ({want})"
        if self.world_size != layout.world_size:
            return f"Slurm step has {self.world_size} tasks but the layout needs {layout.world_size}"
        if self.is_het:
            role = assign_role(self.rank, layout)
            if (role.component, role.index) != (self.component, self.component_rank):
                return (f"rank {self.rank}: Slurm places it in component {self.component} (rank "
                        f"{self.component_rank}) but the layout gives {role.kind} #{role.index} of component "
                        f"{role.component}")
        return None


def in_slurm_step(environ: Mapping[str, str]) -> bool:
    """True for a task started by srun (not for mpirun inside an allocation, nor the batch script)."""
    return "SLURM_PROCID" in environ and "SLURM_STEP_ID" in environ and "SLURM_STEP_NODELIST" in environ


def placement_from_env(environ: Mapping[str, str]) -> SlurmPlacement:
    """The placement of the task whose environment is `environ` (pass os.environ)."""
    rank = _int(environ, "SLURM_PROCID")
    world = _int(environ, "SLURM_STEP_NUM_TASKS", None) or _int(environ, "SLURM_NTASKS")
    het_size = _int(environ, "SLURM_HET_SIZE", 0)
    if het_size:
        sizes = tuple(_int(environ, f"SLURM_NTASKS_HET_GROUP_{i}") for i in range(het_size))
        nodes = tuple(tuple(expand_hostlist(environ[f"SLURM_JOB_NODELIST_HET_GROUP_{i}"]))
                      for i in range(het_size))
    else:
        sizes = (world,)
        nodes = (tuple(expand_hostlist(_nodelist(environ, "SLURM_JOB_NODELIST", "SLURM_NODELIST"))),)
    if sum(sizes) != world:
        raise SlurmEnvError(f"het-group task counts {sizes} sum to {sum(sizes)}, but the step has {world} tasks "
                            "(is this task in a step spanning all het groups? srun --het-group=0-N)")
    if not 0 <= rank < world:
        raise SlurmEnvError(f"SLURM_PROCID={rank} outside a step of {world} tasks")
    component, start = 0, 0
    while rank >= start + sizes[component]:
        start += sizes[component]
        component += 1
    step_nodes = tuple(expand_hostlist(_nodelist(environ, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST",
                                                 "SLURM_NODELIST")))
    return SlurmPlacement(job_id=environ.get("SLURM_JOB_ID", ""), rank=rank, world_size=world,
                          local_rank=_int(environ, "SLURM_LOCALID", 0), component=component,
                          component_rank=rank - start, component_sizes=sizes, component_nodes=nodes,
                          step_nodes=step_nodes, node_name=environ.get("SLURMD_NODENAME"),
                          restart_count=_int(environ, "SLURM_RESTART_COUNT", 0))


COMPILE_CACHE_ENV = "MARLAAS_COMPILE_CACHE"
"""Overrides where the rollout engines' compile caches go (`compile_cache_dir`), in and out of Slurm: set it in
`layout.exports` for a shared or persistent directory of one's choice."""
NODE_TMP_VARIABLES = ("SLURM_TMPDIR", "TMPDIR")
"""Node-local scratch a site may name for a job, in order of preference (SLURM_TMPDIR: a job's own local dir on
sites that make one; TMPDIR: Slurm's job_container/tmpfs and most prologs), before /tmp."""


def node_scratch(environ: Mapping[str, str]) -> Path:
    """This user's node-local scratch directory: `<$SLURM_TMPDIR or $TMPDIR or /tmp>/marlaas_hpc-<uid>`."""
    base = next((environ[name] for name in NODE_TMP_VARIABLES if environ.get(name)), "/tmp")
    return Path(base) / f"marlaas_hpc-{os.getuid()}"


def compile_cache_dir(environ: Mapping[str, str], outside_slurm: Path) -> Path:
    """The root of vLLM's and inductor's compile caches (VLLM_CACHE_ROOT, TORCHINDUCTOR_CACHE_DIR and
    TRITON_CACHE_DIR go under it: rollout/vllm_engine.py): MARLAAS_COMPILE_CACHE when set; in a Slurm job
    (SLURM_JOB_ID), node-local storage, `<$SLURM_TMPDIR or $TMPDIR or /tmp>/marlaas_hpc-<uid>/compile`; else
    `outside_slurm` (the project's cache under the home directory). Under the home directory, usually an NFS
    share, every rank of every node read and wrote one cache (file locks, small writes over the network, and one
    node's half-written entry read by another); node-local, a node compiles once and its later jobs start warm
    where /tmp outlives a job."""
    if environ.get(COMPILE_CACHE_ENV):
        return Path(environ[COMPILE_CACHE_ENV])
    if not environ.get("SLURM_JOB_ID"):
        return Path(outside_slurm)
    return node_scratch(environ) / "compile"


_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def expand_hostlist(hostlist: str) -> list[str]:
    """Slurm hostlist syntax to host names: 'n[1-3,5],gpu[01-02]-ib' -> n1 n2 n3 n5 gpu01-ib gpu02-ib.
    Zero padding is kept; several bracket groups in one name expand as a product (Slurm's order)."""
    hosts: list[str] = []
    for item in _split_top_level(hostlist.strip()):
        hosts.extend(_expand_one(item, hostlist))
    if not hosts:
        raise SlurmEnvError(f"empty hostlist {hostlist!r}")
    return hosts


def _split_top_level(text: str) -> list[str]:
    items, depth, current = [], 0, []
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == "," and depth == 0:
            items.append("".join(current))
            current = []
        else:
            current.append(ch)
        if depth not in (0, 1):
            raise SlurmEnvError(f"unbalanced brackets in hostlist {text!r}")
    if depth:
        raise SlurmEnvError(f"unbalanced brackets in hostlist {text!r}")
    items.append("".join(current))
    return [item.strip() for item in items if item.strip()]


def _expand_one(item: str, whole: str) -> list[str]:
    open_at = item.find("[")
    if open_at < 0:
        return [item]
    close_at = item.index("]", open_at)
    prefix, body, rest = item[:open_at], item[open_at + 1:close_at], item[close_at + 1:]
    suffixes = _expand_one(rest, whole) if rest else [""]
    out = []
    for part in body.split(","):
        match = _RANGE.match(part.strip())
        if not match:
            raise SlurmEnvError(f"bad range {part!r} in hostlist {whole!r}")
        lo, hi = match.group(1), match.group(2) or match.group(1)
        if int(hi) < int(lo):
            raise SlurmEnvError(f"descending range {part!r} in hostlist {whole!r}")
        width = len(lo) if lo.startswith("0") else 0
        for number in range(int(lo), int(hi) + 1):
            out.extend(f"{prefix}{number:0{width}d}{suffix}" for suffix in suffixes)
    return out


def _nodelist(environ: Mapping[str, str], *names: str) -> str:
    for name in names:
        if environ.get(name):
            return environ[name]
    raise SlurmEnvError(f"none of {', '.join(names)} is set: not inside a Slurm job")


_MISSING = object()


def _int(environ: Mapping[str, str], name: str, default=_MISSING):
    value = environ.get(name)
    if value is None or value == "":
        if default is _MISSING:
            raise SlurmEnvError(f"{name} is not set: not a task of a Slurm job step")
        return default
    try:
        return int(value)
    except ValueError:
        raise SlurmEnvError(f"{name}={value!r} is not an integer") from None
