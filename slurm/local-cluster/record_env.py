"""Record the environment every task of a job step sees, as a test fixture.

    python slurm/local-cluster/record_env.py OUT.json [--plain | --spread | --one-node-gpus N | --mpirun N]
                                                      [--rollout-tasks N] [--rollout-gpus N] [--trainer-per-node]

By default it submits a 4-component het job (1 cpu + 1 cpu + 2 gpu + 2 gpu tasks on partitions cpu/gpu,
as start.sh creates them) with one `srun --het-group=0-3` step (--spread: its rollout group on
2 nodes; --rollout-tasks / --rollout-gpus: the rollout group's task count and --gpus-per-task, e.g. one
engine with 2 GPUs; --trainer-per-node: the trainer group asks for its GPUs per node, --gpus-per-node=2
--ntasks-per-node=2, as launch/sbatch.py renders a TP trainer); --plain: one plain step of 3 tasks on 2 nodes;
--one-node-gpus N: one plain step of --ntasks tasks (default 8) on one gpu node that asks for N GPUs per node
(--gres=gpu:N, no per-task binding: every task sees all N); --mpirun N: `mpirun -np N` on this machine, no
Slurm (Open MPI's variables).
Keeps SLURM_*, SLURMD_NODENAME, CUDA_VISIBLE_DEVICES and the MPI launchers' rank variables; the fixture
is a list (one dict per world rank). Run it on a real site to add that site's environment to
tests/golden/slurm_env/ or tests/golden/device_env/.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HET_HEADER = """#SBATCH --partition=cpu --ntasks=1
#SBATCH hetjob
#SBATCH --partition=cpu --ntasks=1
#SBATCH hetjob
#SBATCH --partition=gpu {rollout}
#SBATCH hetjob
#SBATCH --partition=gpu {trainer}
"""
PLAIN_HEADER = "#SBATCH --partition=cpu --nodes=2 --ntasks=3\n"
ONE_NODE_HEADER = "#SBATCH --partition=gpu --nodes=1 --ntasks={ntasks} --gres=gpu:{gpus}\n"
KEEP = ("SLURMD_NODENAME", "CUDA_VISIBLE_DEVICES", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")
DUMP = ("import json, os, sys; keep = {k: v for k, v in os.environ.items() if k.startswith(('SLURM', 'OMPI_COMM_WORLD')) "
        f"or k in {KEEP!r}}}; "
        "rank = os.environ.get('OMPI_COMM_WORLD_RANK') or os.environ['SLURM_PROCID']; "
        "open(os.path.join(sys.argv[1], 'rank%s.json' % rank), 'w').write(json.dumps(keep))")


def _header(args) -> str:
    if args.plain:
        return PLAIN_HEADER
    if args.one_node_gpus:
        return ONE_NODE_HEADER.format(ntasks=args.ntasks, gpus=args.one_node_gpus)
    rollout = f"--ntasks={args.rollout_tasks} --gpus-per-task={args.rollout_gpus}"
    if args.spread:
        rollout = f"--nodes={args.rollout_tasks} " + rollout
    trainer = "--ntasks=2 --ntasks-per-node=2 --gpus-per-node=2" if args.trainer_per_node else \
        "--ntasks=2 --gpus-per-task=1"
    return HET_HEADER.format(rollout=rollout, trainer=trainer)


def _run_slurm(args, work: Path) -> None:
    srun = "srun" if args.plain or args.one_node_gpus else "srun --het-group=0-3"
    script = work / "job.sh"
    script.write_text(f"#!/bin/bash\n#SBATCH --output={work}/batch.out\n"
                      f"{_header(args)}"
                      f"{srun} {sys.executable} -c \"{DUMP}\" {work}\n")
    job_id = subprocess.run(["sbatch", "--parsable", str(script)], check=True, capture_output=True,
                            text=True).stdout.strip().split(";")[0]
    deadline = time.time() + 60
    while time.time() < deadline:
        state = subprocess.run(["sacct", "-n", "-X", "-P", "-o", "State", "-j", job_id], capture_output=True,
                               text=True).stdout.split()
        if state and all(s == "COMPLETED" for s in state):
            break
        time.sleep(0.5)
    else:
        raise SystemExit(f"job {job_id} did not complete: {state}; see {work}")
    print(f"job {job_id}")


def _run_mpirun(args, work: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM") and k != "CUDA_VISIBLE_DEVICES"}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    subprocess.run(["mpirun", "-np", str(args.mpirun), "--oversubscribe", sys.executable, "-c", DUMP, str(work)],
                   check=True, env=env, timeout=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--plain", action="store_true", help="a plain (non-het) step instead")
    parser.add_argument("--spread", action="store_true", help="het job whose rollout group spans its own nodes")
    parser.add_argument("--rollout-tasks", type=int, default=2, help="rollout tasks of the het job")
    parser.add_argument("--rollout-gpus", type=int, default=1, help="--gpus-per-task of the rollout group")
    parser.add_argument("--trainer-per-node", action="store_true",
                        help="het job whose trainer group asks for GPUs per node (--gpus-per-node=2)")
    parser.add_argument("--one-node-gpus", type=int, metavar="N", help="plain step on one node with N GPUs")
    parser.add_argument("--ntasks", type=int, default=8, help="tasks of the --one-node-gpus step")
    parser.add_argument("--mpirun", type=int, metavar="N", help="mpirun -np N on this machine instead of Slurm")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="slurm-env-", dir="/var/tmp"))
    if args.mpirun:
        _run_mpirun(args, work)
    else:
        _run_slurm(args, work)
    ranks = sorted(work.glob("rank*.json"), key=lambda p: int(p.stem[4:]))
    Path(args.out).write_text(json.dumps([json.loads(p.read_text()) for p in ranks], indent=1, sort_keys=True)
                              + "\n")
    print(f"{len(ranks)} ranks -> {args.out}")


if __name__ == "__main__":
    main()
