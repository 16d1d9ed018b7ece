"""`layout.mpi: ulfm` (launch/ulfm_slurm.py): the ULFM mpiexec's plan from a het job's batch environment (recorded
on the local cluster), each rank's srun-like environment, the daemons' srun, and the batch script's step."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from marlaas_hpc.launch.layout import JobLayout, assign_role
from marlaas_hpc.launch.sbatch import render_sbatch
from marlaas_hpc.launch.slurm_env import placement_from_env
from marlaas_hpc.launch.ulfm_slurm import agent_argv, make_plan, rank_environ, rank_hosts, step_nodes, tasks_per_node

BATCH_ENV = {  # the batch script's environment of a 4-component het job (1, 1, 2, 2 tasks; rollout on 2 nodes)
    "SLURM_JOB_ID": "41", "SLURM_HET_SIZE": "4",
    "SLURM_JOB_NODELIST_HET_GROUP_0": "c1", "SLURM_TASKS_PER_NODE_HET_GROUP_0": "1",
    "SLURM_JOB_NODELIST_HET_GROUP_1": "c2", "SLURM_TASKS_PER_NODE_HET_GROUP_1": "1",
    "SLURM_JOB_NODELIST_HET_GROUP_2": "g[1-2]", "SLURM_TASKS_PER_NODE_HET_GROUP_2": "1(x2)",
    "SLURM_JOB_NODELIST_HET_GROUP_3": "g3", "SLURM_TASKS_PER_NODE_HET_GROUP_3": "2",
    # what the daemon's own srun step leaves in every rank it starts: the rank must not take them for its own
    "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NTASKS": "1", "SLURM_STEP_ID": "3", "SLURM_STEP_NODELIST": "g3",
}


@pytest.mark.parametrize("text, counts", [("2", [2]), ("1(x2)", [1, 1]), ("2(x3),1", [2, 2, 2, 1]),
                                          ("4,2(x2)", [4, 2, 2])])
def test_tasks_per_node(text, counts):
    assert tasks_per_node(text) == counts


def test_plan_puts_ranks_in_component_order():
    plan = make_plan(BATCH_ENV, cpus=[2, 1, 2, 4], gpus=[0, 0, 1, 1])
    assert [(n.group, n.host, n.tasks) for n in step_nodes(BATCH_ENV)] == [
        (0, "c1", 1), (1, "c2", 1), (2, "g1", 1), (2, "g2", 1), (3, "g3", 2)]
    assert rank_hosts(plan) == ["c1", "c2", "g1", "g2", "g3", "g3"]
    with pytest.raises(ValueError, match="4 het components"):
        make_plan(BATCH_ENV, cpus=[2, 1], gpus=[0, 0])


def test_each_rank_sees_the_het_step_srun_would_have_given_it():
    plan = make_plan(BATCH_ENV, cpus=[2, 1, 2, 4], gpus=[0, 0, 1, 1])
    layout = JobLayout(env_ranks=1, rollout_ranks=2, trainer_tp=2)
    local = [0, 0, 0, 0, 0, 1]
    for rank in range(6):
        env = rank_environ({**BATCH_ENV, "OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": "6",
                            "OMPI_COMM_WORLD_LOCAL_RANK": str(local[rank])}, plan)
        placement = placement_from_env(env)
        role = assign_role(rank, layout)
        assert placement.rank == rank and placement.world_size == 6 and placement.local_rank == local[rank]
        assert placement.component == role.component and placement.component_sizes == (1, 1, 2, 2)
        assert placement.mismatch_with(layout) is None and placement.rendezvous_host == "c1"
    trainer = rank_environ({**BATCH_ENV, "OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "6"}, plan)
    assert trainer["SLURM_GTIDS"] == "4,5" and trainer["SLURM_NODEID"] == "4"
    with pytest.raises(ValueError, match="6 ranks planned"):
        rank_environ({**BATCH_ENV, "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "5"}, plan)


def test_a_daemon_starts_in_its_component_with_what_its_ranks_hold_there():
    plan = make_plan(BATCH_ENV, cpus=[2, 1, 2, 4], gpus=[0, 0, 1, 1])
    argv = agent_argv(plan, "g3", ["PRTE_PREFIX=/x;", "prted", "--x"], emulated=False)
    assert argv[:2] == ["srun", "--het-group=3"] and "--kill-on-bad-exit=0" in argv and "--overlap" in argv
    assert "--cpus-per-task=8" in argv and "--gres=gpu:2" in argv
    assert argv[-3:] == ["/bin/sh", "-c", "trap '' USR2; PRTE_PREFIX=/x; prted --x"]
    env_daemon = agent_argv(plan, "c2", ["prted"], emulated=True)
    assert not any(a.startswith("--gres") for a in env_daemon) and "--cpus-per-task=1" in env_daemon
    assert env_daemon[-5:] == ["unshare", "--uts", "/bin/sh", "-c", "hostname c2; trap '' USR2; prted"]


def test_gpu_daemons_are_bound_to_their_cpus_and_the_cpu_twin_floats():
    """A daemon of a GPU component on a real cluster is bound to the CPUs Slurm gave it on the node (its ranks inherit
    them and each narrows to those near its GPU: launch/devices.py); CPU components, and every daemon on emulated
    nodes (the CPU twin oversubscribes its cores), float. PRRTE binds nothing (it cannot know a rank's GPU)."""
    from marlaas_hpc.launch.mpi import LocalMpi
    from marlaas_hpc.launch.ulfm_slurm import mpiexec_argv

    plan = make_plan(BATCH_ENV, cpus=[2, 1, 2, 4], gpus=[0, 0, 1, 1])
    binding = {host: [a for a in agent_argv(plan, host, ["prted"], emulated=False) if a.startswith("--cpu-bind")]
               for host in ("c1", "c2", "g1", "g3")}
    assert binding == {"c1": ["--cpu-bind=none"], "c2": ["--cpu-bind=none"], "g1": ["--cpu-bind=cores"],
                       "g3": ["--cpu-bind=cores"]}
    assert "--cpu-bind=none" in agent_argv(plan, "g3", ["prted"], emulated=True)
    argv = mpiexec_argv(LocalMpi("ulfm", "/u/bin/mpiexec", Path("/u")), plan, Path("/h"), Path("/a"), "python x")
    assert argv[argv.index("--bind-to") + 1] == "none"


def _survives_usr2(argv: list[str], env: dict | None = None) -> bool:
    """Starts `argv` (which runs `sleep 30` in a shell) in a process group of its own, sends USR2 to the group (as
    Slurm signals every process of a step), and tells whether the shell and its child are still there."""
    import os
    import signal
    import subprocess
    import time

    import psutil

    proc = subprocess.Popen(argv, start_new_session=True, env=env)
    try:
        deadline = time.monotonic() + 30
        while not psutil.Process(proc.pid).children() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert psutil.Process(proc.pid).name() == "sh", "the shell runs, its sleep under it"
        group = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children()]
        os.killpg(proc.pid, signal.SIGUSR2)
        time.sleep(0.5)
        return proc.poll() is None and all(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in group)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_the_daemons_shell_survives_usr2():
    """Slurm's --signal=USR2@lead signals every process of the daemon's srun step: its shell died of it, which ended
    the step and every rank of the node."""
    plan = make_plan(BATCH_ENV, cpus=[2, 1, 2, 4], gpus=[0, 0, 1, 1])
    shell = agent_argv(plan, "g3", ["sleep", "30;", "true"], emulated=False)[-3:]
    assert _survives_usr2(shell)


def test_the_shell_around_each_rank_survives_usr2():
    """`ulfm_slurm rank -- /bin/sh -c COMMAND`: PRRTE took the shell's death for the rank's."""
    import os
    import sys

    from marlaas_hpc.launch.ulfm_slurm import PLAN_ENV

    plan = make_plan(BATCH_ENV, cpus=[2, 1, 2, 4], gpus=[0, 0, 1, 1])
    env = {**os.environ, **BATCH_ENV, PLAN_ENV: json.dumps(plan), "OMPI_COMM_WORLD_RANK": "2",
           "OMPI_COMM_WORLD_SIZE": "6", "OMPI_COMM_WORLD_LOCAL_RANK": "0"}
    assert _survives_usr2([sys.executable, "-m", "marlaas_hpc.launch.ulfm_slurm", "rank", "--", "/bin/sh", "-c",
                           "sleep 30; true"], env)


def test_the_batch_script_runs_ulfms_mpiexec_instead_of_srun():
    layout = JobLayout.from_dict({"env_ranks": 1, "rollout_ranks": 2, "trainer_tp": 2, "mpi": "ulfm",
                                  "emulated_nodes": True, "rollout": {"gpus_per_task": 1},
                                  "trainer": {"gpus_per_task": 1}}).validate()
    text = render_sbatch(layout, "python -m marlaas_hpc.runtime.main job.yaml --run-dir r", "demo", "/tmp/f")
    step = [line for line in text.splitlines() if "ulfm_slurm launch" in line]
    assert len(step) == 1 and "launch --cpus 1,1,1,1 --gpus 0,0,1,1 -- " in step[0]
    assert "'python -m marlaas_hpc.runtime.main job.yaml --run-dir r'" in step[0]
    assert "-m marlaas_hpc.launch.step_guard --grace=60 -- " in step[0] and "srun --" not in text and "--mpi=" not in text
    assert "export MARLAAS_EMULATED_NODES=1" in text and "OMPI_MCA_btl" not in text
    assert text.count("#SBATCH --no-kill") == 1  # a failed node ends its ranks, not the allocation
    srun = render_sbatch(JobLayout(), "python x", "demo", "/tmp/f")
    assert "--mpi=pmix" in srun and "--no-kill" not in srun


def test_the_submitit_script_asks_for_no_kill_under_ulfm(tmp_path):
    from marlaas_hpc.launch.submitit_hetjob import HetJobExecutor

    layout = JobLayout.from_dict({"mpi": "ulfm", "emulated_nodes": True}).validate()
    text = HetJobExecutor(tmp_path, layout)._make_submission_file_text("python -u -m x", "uid")
    assert "#SBATCH --no-kill" in text and "ulfm_slurm launch" in text


def test_a_rank_that_joins_in_a_slot_gets_the_variables_and_the_gpu_of_that_slots_rank():
    """`ulfm_slurm join SLOT`: a rank spawned into the live job (runtime/scaling.py) sees the SLURM_* variables of
    the slot's rank, not its daemon's step nor its own spawn's world, so launch/devices.py binds it to the GPU that
    rank had (both rollout ranks on one node, the daemon's step holding the node's two GPUs)."""
    from marlaas_hpc.launch.devices import bind_device, node_ranks_from_env
    from marlaas_hpc.launch.ulfm_slurm import JOIN_SLOT_ENV, join_argv, main, slot_environ, slot_host

    batch = {**BATCH_ENV, "SLURM_JOB_NODELIST_HET_GROUP_2": "g1", "SLURM_TASKS_PER_NODE_HET_GROUP_2": "2"}
    plan = make_plan(batch, cpus=[2, 1, 2, 4], gpus=[0, 0, 1, 1])
    layout = JobLayout.from_dict({"env_ranks": 1, "rollout_ranks": 2, "trainer_tp": 2,
                                  "rollout": {"gpus_per_task": 1}, "trainer": {"gpus_per_task": 1}}).validate()
    daemon = {**batch, "CUDA_VISIBLE_DEVICES": "0,1"}
    original = rank_environ({**daemon, "OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "6",
                             "OMPI_COMM_WORLD_LOCAL_RANK": "1"}, plan)
    joined = slot_environ(daemon, plan, 3)  # what `join 3` gives the spawned process (its own OMPI_* aside)
    for key in ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_GTIDS", "SLURM_NODEID", "SLURM_HET_SIZE"):
        assert joined[key] == original[key], key
    was = bind_device(original, 3, layout, driver_gpus=4, node_ranks=[2, 3])
    now = bind_device(joined, 3, layout, driver_gpus=4, node_ranks=node_ranks_from_env(joined))
    assert was.gpus == now.gpus == ("1",) and now.role == "rollout"
    assert slot_host({"MARLAAS_ULFM_PLAN": json.dumps(plan)}, 3) == "g1"
    assert join_argv(3, ["python", "-m", "x"]) == ["-m", "marlaas_hpc.launch.ulfm_slurm", "join", "3", "--",
                                                   "python", "-m", "x"]
    assert JOIN_SLOT_ENV == "MARLAAS_JOIN_SLOT" and main(["nothing"]) == 2


def test_ranks_join_under_slurm_only_with_ulfm_and_a_tolerant_job():
    """runtime/scaling.py `why_not_join`: a plain srun step (mpi: pmix, no ULFM) keeps its refusal, a rank under this
    module's mpiexec (its plan in the environment) may join, local mode too; a job that stops on a loss never."""
    from marlaas_hpc.runtime.membership import Membership
    from marlaas_hpc.runtime.scaling import why_not_join

    srun_task = {"SLURM_PROCID": "0", "SLURM_STEP_ID": "0", "SLURM_STEP_NODELIST": "c1"}
    tolerant = Membership({"rollout": [2]}, tolerant=True)
    assert why_not_join(tolerant, srun_task) == "under Slurm, ranks join only with layout.mpi: ulfm"
    assert why_not_join(tolerant, {**srun_task, "MARLAAS_ULFM_PLAN": "{}"}) is None
    assert why_not_join(tolerant, {}) is None
    stopping = Membership({"rollout": [2]}, tolerant=False, why_not="the MPI in use has no fault tolerance")
    assert why_not_join(stopping, {}) == "the MPI in use has no fault tolerance"
    assert why_not_join(Membership({"rollout": [2]}), srun_task) == "fault.on_rank_loss: stop"
