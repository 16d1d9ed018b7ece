#!/bin/bash

# Parameters
#SBATCH --cpus-per-task=1
#SBATCH --error=/scratch/marlaas/runs/demo/%j_0_log.err
#SBATCH --job-name=demo
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --open-mode=append
#SBATCH --output=/scratch/marlaas/runs/demo/%j_0_log.out
#SBATCH --partition=cpu
#SBATCH --requeue
#SBATCH --signal=USR2@60
#SBATCH --time=30
#SBATCH --wckey=submitit

# setup
#SBATCH hetjob
# het group 1: env (2 ranks)
#SBATCH --partition=cpu
#SBATCH --nodes=1
#SBATCH --ntasks=2
#SBATCH --cpus-per-task=1
#SBATCH --time=00:30:00
#SBATCH --signal=USR2@60
#SBATCH hetjob
# het group 2: rollout (1 ranks)
#SBATCH --partition=cpu
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --cpus-per-task=2
#SBATCH --time=00:30:00
#SBATCH --signal=USR2@60
#SBATCH hetjob
# het group 3: trainer (2 ranks)
#SBATCH --partition=cpu
#SBATCH --nodes=1
#SBATCH --ntasks=2
#SBATCH --cpus-per-task=1
#SBATCH --time=00:30:00
#SBATCH --signal=USR2@60
set -euo pipefail
export OMPI_MCA_pml=ob1
export OMPI_MCA_btl=self,tcp
export OMPI_MCA_btl_tcp_if_include=lo
export OMPI_MCA_oob_tcp_if_include=lo
export NCCL_SOCKET_IFNAME=lo
export GLOO_SOCKET_IFNAME=lo
export OMP_NUM_THREADS=1

# command
export SUBMITIT_EXECUTOR=slurm
/opt/marlaas/.venv/bin/python -m marlaas_hpc.launch.step_guard --grace=60 -- srun --unbuffered --kill-on-bad-exit=1 --mpi=pmix \
    --het-group=0 --cpus-per-task=1 : \
    --het-group=1 --cpus-per-task=1 : \
    --het-group=2 --cpus-per-task=2 : \
    --het-group=3 --cpus-per-task=1 \
    /opt/marlaas/.venv/bin/python -u -m marlaas_hpc.launch.hetjob_task /scratch/marlaas/runs/demo
