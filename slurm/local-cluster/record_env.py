"""Record the Slurm environment every task of a job step sees, as a test fixture.

    python slurm/local-cluster/record_env.py OUT.json [--plain | --spread]

By default it submits a 4-component het job (1 cpu + 1 cpu + 2 gpu + 2 gpu tasks on partitions cpu/gpu,
as start.sh creates them) with one `srun --het-group=0-3` step (--spread: its rollout group on
2 nodes); --plain: one plain step of 3 tasks on 2 nodes. Keeps SLURM_*, SLURMD_NODENAME and
CUDA_VISIBLE_DEVICES; the fixture is a list (one dict per world rank). Run it on a real site to add
that site's environment to tests/golden/slurm_env/.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HET_HEADER = """#SBATCH --partition=cpu --ntasks=1
#SBATCH hetjob
#SBATCH --partition=cpu --ntasks=1
#SBATCH hetjob
#SBATCH --partition=gpu --ntasks=2 --gpus-per-task=1
#SBATCH hetjob
#SBATCH --partition=gpu --ntasks=2 --gpus-per-task=1
"""
PLAIN_HEADER = "#SBATCH --partition=cpu --nodes=2 --ntasks=3\n"
DUMP = ("import json, os, sys; keep = {k: v for k, v in os.environ.items() if k.startswith('SLURM') "
        "or k in ('SLURMD_NODENAME', 'CUDA_VISIBLE_DEVICES')}; "
        "open(os.path.join(sys.argv[1], 'rank%s.json' % os.environ['SLURM_PROCID']), 'w').write(json.dumps(keep))")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--plain", action="store_true", help="a plain (non-het) step instead")
    parser.add_argument("--spread", action="store_true", help="het job whose rollout group spans 2 nodes")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="slurm-env-", dir="/var/tmp"))
    srun = "srun" if args.plain else "srun --het-group=0-3"
    header = PLAIN_HEADER if args.plain else HET_HEADER
    if args.spread:
        header = header.replace("--partition=gpu --ntasks=2 --gpus-per-task=1", "--partition=gpu --nodes=2 "
                                "--ntasks=2 --gpus-per-task=1", 1)
    script = work / "job.sh"
    script.write_text(f"#!/bin/bash\n#SBATCH --output={work}/batch.out\n"
                      f"{header}"
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
    ranks = sorted(work.glob("rank*.json"), key=lambda p: int(p.stem[4:]))
    Path(args.out).write_text(json.dumps([json.loads(p.read_text()) for p in ranks], indent=1, sort_keys=True)
                              + "\n")
    print(f"{len(ranks)} ranks of job {job_id} -> {args.out}")


if __name__ == "__main__":
    main()
