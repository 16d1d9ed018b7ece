"""Self-checking programs for a site (and the slurm tests): run them through HetJobExecutor.

`hetjob_probe(layout)`: every rank checks that MPI_COMM_WORLD has the layout's size, that its role from
`assign_role` agrees with the component Slurm put it in, and the whole world agrees on the role map; it also
returns the CPUs it may run on and the variables its device binding comes from.
`RequeueProbe`: a Checkpointable that waits for USR2 on its first run and proves, after the requeue,
that checkpoint() ran, SLURM_RESTART_COUNT went up and state written before the requeue survived.
"""
from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from submitit.helpers import Checkpointable

from marlaas_hpc.launch.layout import JobLayout, assign_role, world_size_matches
from marlaas_hpc.launch.slurm_env import placement_from_env


LAUNCHER_VARIABLES = ("SLURM_PROCID", "SLURM_GTIDS", "SLURM_STEP_ID", "SLURM_GPUS_ON_NODE", "SLURM_STEP_GPUS",
                      "SLURMD_NODENAME", "CUDA_VISIBLE_DEVICES")
"""What a rank's device binding is computed from (launch/devices.py); the probe returns them."""


def hetjob_probe(layout: JobLayout) -> dict[str, Any]:
    """Run on every rank of a het job step; returns this rank's view, raises on any rank's mismatch."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    placement = placement_from_env(os.environ)
    problems = []
    check = world_size_matches(layout, size)
    if not check:
        problems.append(check.message)
    if rank != placement.rank:
        problems.append(f"MPI rank {rank} != SLURM_PROCID {placement.rank}")
    mismatch = placement.mismatch_with(layout)
    if mismatch:
        problems.append(mismatch)
    role = assign_role(rank, layout) if check else None
    view = {"rank": rank, "world_size": size, "slurm_component": placement.component,
            "slurm_component_rank": placement.component_rank, "role": role and role.kind,
            "role_index": role and role.index, "tp_rank": role and role.tp_rank, "dp_rank": role and role.dp_rank,
            "trainer_group": role and role.group,
            "node": placement.node_name, "host": socket.gethostname(), "job_id": placement.job_id,
            "rendezvous_host": placement.rendezvous_host,
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "cpus": len(os.sched_getaffinity(0)),
            "environ": {name: os.environ[name] for name in LAUNCHER_VARIABLES if name in os.environ},
            "problems": problems}
    everyone = comm.allgather(view)  # a collective: proves the world is really connected
    bad = [f"rank {v['rank']}: {p}" for v in everyone for p in v["problems"]]
    if bad:
        raise RuntimeError("het job probe failed: " + "; ".join(bad))
    view["world_roles"] = [(v["role"], v["role_index"], v["slurm_component"]) for v in everyone]
    return view


class RequeueProbe(Checkpointable):
    """First run: rank 0 writes STATE_DIR/state.json, each rank READY.<rank>, then every rank waits (interruptible
    sleeps, so Python's USR2 handler runs) for the preemption signal. After the requeue it returns what
    it found. Rank 0 only: submitit checkpoints and requeues from world rank 0."""

    def __call__(self, state_dir: str, wait_s: float = 120.0) -> dict[str, Any]:
        state = Path(state_dir)
        rank = int(os.environ.get("SLURM_PROCID", 0))
        restart = int(os.environ.get("SLURM_RESTART_COUNT", 0))
        if restart == 0:
            if rank == 0:
                _write_json(state / "state.json", {"written_at_restart": 0, "step": 41})
            # each rank says it runs (submitit's signal handlers are set by now): a USR2 sent before a rank
            # got here would kill it with the default action, not preempt it
            (state / f"READY.{rank}").touch()
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline:
                time.sleep(0.2)
            raise TimeoutError(f"no preemption signal within {wait_s} s")
        saved = json.loads((state / "state.json").read_text()) if rank == 0 else None
        return {"rank": rank, "restart_count": restart, "saved": saved,
                "checkpointed": (state / "CHECKPOINTED").exists()}

    def checkpoint(self, state_dir: str, wait_s: float = 120.0) -> Any:
        Path(state_dir, "CHECKPOINTED").write_text(str(time.time()))
        return super().checkpoint(state_dir, wait_s)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def main() -> None:
    """`srun ... python -m marlaas_hpc.launch.probe LAYOUT.yaml`: one JSON line per rank; exit 1 on a mismatch."""
    import sys

    import yaml

    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m marlaas_hpc.launch.probe LAYOUT.yaml")
    layout = JobLayout.from_dict(yaml.safe_load(Path(sys.argv[1]).read_text()))
    try:
        view = hetjob_probe(layout)
    except RuntimeError as exc:
        print(f"[probe] {exc}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    view.pop("world_roles")
    print(json.dumps(view, sort_keys=True), flush=True)


if __name__ == "__main__":
    main()
