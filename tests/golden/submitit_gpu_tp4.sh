#!/bin/bash

# Parameters
#SBATCH --account=rlgroup
#SBATCH --cpus-per-task=4
#SBATCH --error=/scratch/marlaas/runs/demo/%j_0_log.err
#SBATCH --job-name=demo
#SBATCH --mem=16G
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --open-mode=append
#SBATCH --output=/scratch/marlaas/runs/demo/%j_0_log.out
#SBATCH --partition=cpu
#SBATCH --requeue
#SBATCH --signal=USR2@300
#SBATCH --time=720
#SBATCH --wckey=submitit

# setup
#SBATCH hetjob
# het group 1: env (8 ranks)
#SBATCH --partition=cpu
#SBATCH --nodes=2
#SBATCH --ntasks=8
#SBATCH --ntasks-per-node=4
#SBATCH --cpus-per-task=4
#SBATCH --mem=64G
#SBATCH --time=12:00:00
#SBATCH --account=rlgroup
#SBATCH --signal=USR2@300
#SBATCH hetjob
# het group 2: rollout (4 ranks)
#SBATCH --partition=gpu
#SBATCH --nodes=4
#SBATCH --ntasks=4
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=16
#SBATCH --gpus-per-task=1
#SBATCH --mem=200G
#SBATCH --time=12:00:00
#SBATCH --account=rlgroup
#SBATCH --qos=high
#SBATCH --constraint=h100
#SBATCH --signal=USR2@300
#SBATCH hetjob
# het group 3: trainer (8 ranks)
#SBATCH --partition=gpu
#SBATCH --nodes=2
#SBATCH --ntasks=8
#SBATCH --ntasks-per-node=4
#SBATCH --cpus-per-task=16
#SBATCH --gpus-per-node=4
#SBATCH --mem=400G
#SBATCH --time=1-00:00:00
#SBATCH --account=rlgroup
#SBATCH --qos=high
#SBATCH --constraint=h100
#SBATCH --signal=USR2@300
#SBATCH --exclusive
set -euo pipefail
module load openmpi/4.1.6 cuda/12.4
source /opt/marlaas/.venv/bin/activate
export OMPI_MCA_btl_tcp_if_include=ib0
export OMPI_MCA_oob_tcp_if_include=ib0
export NCCL_SOCKET_IFNAME=ib0
export GLOO_SOCKET_IFNAME=ib0
export OMP_NUM_THREADS=1
export NCCL_IB_HCA=mlx5

# command
export SUBMITIT_EXECUTOR=slurm
/opt/marlaas/.venv/bin/python -m marlaas_hpc.launch.step_guard --grace=60 -- srun --unbuffered --kill-on-bad-exit=1 --mpi=pmix \
    --het-group=0 --cpus-per-task=4 : \
    --het-group=1 --cpus-per-task=4 : \
    --het-group=2 --cpus-per-task=16 : \
    --het-group=3 --cpus-per-task=16 \
    /opt/marlaas/.venv/bin/python -u -m marlaas_hpc.launch.hetjob_task /scratch/marlaas/runs/demo
