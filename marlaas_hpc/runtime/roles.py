"""The wiring of each role: what a rank builds for its role, in which order, and the loop it then runs.

    run_rank ── RankSetup.of (collective: model dirs, resume seeds, resume points) ──┬─ run_scheduler  (rank 0)
                                                                                    ├─ run_env
                                                                                    ├─ run_rollout
                                                                                    └─ run_trainer    (leader, follower)

Every role reaches the same collectives in the same order: its part of the delta plane's set-up
(runtime/delta/plane.py `DeltaPlane`: under `delta.transport: relay` a collective over the world; the broadcast's
DeltaOrder and channels) and then the ready barrier (`_ready`): TTFS and busy fractions measure the job, not engine start-up. The order of communicator
creation is part of the protocol: keep the statements' order where collectives are set up.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from marlaas_hpc.config import JobConfig
from marlaas_hpc.launch.layout import assign_role, trainer_group_ranks
from marlaas_hpc.launch.gpu_share import cap_trainer_memory, gpu_turns, trainer_memory_fraction
from marlaas_hpc.runtime.comm import quiet_barrier, recv_wait
from marlaas_hpc.runtime.engines import model_engines, repack_roles, rollout_engine
from marlaas_hpc.runtime.process import roles_of


@dataclass
class RankSetup:
    """What every role's wiring starts from, the same on every rank but `role` (and `resume`: rank 0's)."""

    comm: object
    job: JobConfig
    role: object
    roles: dict[str, list[int]]
    run_dir: Path
    model_paths: dict[str, Path]
    """Every base model's dir by name, the default first."""
    codec: object
    model_codecs: dict | None
    """A job of several base models, rank 0 and env ranks: each model's codec."""
    groups: list[list[int]]
    leaders: list[int]
    seed: int
    resume: dict | None
    start: float
    log: object

    @classmethod
    def of(cls, comm, job: JobConfig, log, resume: dict | None) -> "RankSetup":
        """Collective over the world (two broadcasts, and on a resume the check of every trainer rank's shards)."""
        from marlaas_hpc.model import TextCodec

        start = time.time()
        rank = comm.Get_rank()
        role = assign_role(rank, job.layout)
        roles = roles_of(job.layout)
        run_dir = Path(job.run_dir).resolve()
        # every base model's dir by name (rank 0 builds the tiny model / a random checkpoint once), the default first
        model_paths = {name: Path(path) for name, path in comm.bcast(
            {name: str(path) for name, path in job.model_paths().items()} if rank == 0 else None, root=0).items()}
        codec = TextCodec.from_pretrained(next(iter(model_paths.values())))
        # a job of several base models: rank 0 encodes and env ranks decode each task with its model's tokenizer
        model_codecs = ({name: TextCodec.from_pretrained(path) for name, path in model_paths.items()}
                        if len(model_paths) > 1 and role.kind in ("scheduler", "env") else None)
        groups = trainer_group_ranks(job.layout)
        # a resumed run samples with fresh seeds: replaying an earlier run's seeds would repeat its samples
        restarts = comm.bcast(len(resume["runs"]) + bool(resume.get("current_run")) if resume else 0, root=0)
        if restarts:  # every trainer rank checks the shards the resume would load (a corrupt one: fall back)
            from marlaas_hpc.runtime.checkpoint import role_shard
            from marlaas_hpc.runtime.recovery import choose_resume_points

            shard = role_shard(role, job.layout.trainer_ep) if role.kind == "trainer" else None
            resume = choose_resume_points(comm, run_dir, resume, roles["trainer"], shard, log=log)
        return cls(comm, job, role, roles, run_dir, model_paths, codec, model_codecs, groups,
                   [ranks[0] for ranks in groups], job.seed + 100_003 * restarts, resume, start, log)

    @property
    def model_path(self) -> Path:
        return next(iter(self.model_paths.values()))

    def delta_plane(self):
        """The job's delta plane (runtime/delta): every role calls its part once, just before the ready barrier."""
        from marlaas_hpc.runtime.delta import delta_plane

        return delta_plane(self.job.delta, self.roles["rollout"], self.leaders)


def run_rank(comm, job: JobConfig, binding, log=print, preempt=None, resume: dict | None = None,
             devices=None) -> dict | None:
    """Sets up this rank's role on its device (`binding`, from bind_rank_device), waits until every rank is ready,
    then runs the role's loop. Rank 0 returns the summary. `resume` (rank 0): the checkpoint this run continues
    from; `devices` (rank 0): every rank's binding and the node's GPUs, which joiners are given from."""
    setup = RankSetup.of(comm, job, log, resume)
    kind = setup.role.kind
    if kind == "scheduler":
        return run_scheduler(setup, preempt, devices)
    if kind == "env":
        run_env(setup)
    elif kind == "rollout":
        run_rollout(setup, binding)
    else:
        run_trainer(setup, binding)
    return None


def run_scheduler(setup: RankSetup, preempt, devices=None) -> dict:
    from marlaas_hpc.runtime.scheduler_rank import SchedulerRank

    comm = setup.comm
    setup.run_dir.mkdir(parents=True, exist_ok=True)
    order = setup.delta_plane().for_scheduler(comm)
    quiet_barrier(comm)
    readiness = comm.gather(None, root=0)[1:]
    setup.log(f"[job] all {comm.Get_size()} ranks ready after {time.time() - setup.start:.1f} s "
              f"({describe_readiness(readiness)})")
    scheduler = SchedulerRank(comm, setup.job, setup.roles, setup.codec, setup.run_dir, log=setup.log,
                              startup_s=time.time() - setup.start, preempt=preempt, resume=setup.resume,
                              model_codecs=setup.model_codecs)
    scheduler.delta_order = order
    if devices is not None:
        scheduler.ranks.scaler.know_devices(*devices)
    comm.start_heartbeat(scheduler.busy)
    return scheduler.run()


def run_env(setup: RankSetup) -> None:
    from marlaas_hpc.runtime.env_rank import EnvRank

    comm, job = setup.comm, setup.job
    worker = EnvRank(comm, setup.codec, setup.leaders[0], run_dir=setup.run_dir, pool_config=job.env_pool,
                     sandbox=job.sandbox, group_leaders=setup.leaders, model_codecs=setup.model_codecs)
    setup.delta_plane().for_bystander(comm)
    _ready(comm, comm.Get_rank(), "env", setup.start)
    comm.start_heartbeat(worker.clock)
    worker.run()


def run_rollout(setup: RankSetup, binding) -> None:
    from marlaas_hpc.runtime.rollout_rank import RolloutRank

    comm, job, roles = setup.comm, setup.job, setup.roles
    rank, run_dir, seed = comm.Get_rank(), setup.run_dir, setup.seed
    t0 = time.time()
    turns = gpu_turns(job.layout.share_gpus, binding, run_dir, log=setup.log)
    engine = (model_engines(job, setup.model_paths, rank, seed, binding.device, run_dir, turns)
              if len(setup.model_paths) > 1 else
              rollout_engine(job, setup.model_path, rank, seed, binding.device, run_dir, turns=turns))
    engine_up = time.time()
    if job.layout.share_gpus:
        _engine_is_up(comm, roles["trainer"])
    delta = setup.delta_plane().for_rollout(comm, binding.device)
    worker = RolloutRank(comm, engine, delta, seed=seed, run_dir=run_dir, model_dir=setup.model_path,
                         **repack_roles(job, rank, roles["rollout"]))
    worker.clock.note("start_engine", (), t0, engine_up)
    _ready(comm, rank, "rollout", setup.start)
    comm.start_heartbeat(worker.clock)
    worker.run()


def run_trainer(setup: RankSetup, binding) -> None:
    from marlaas_hpc.runtime.trainer_rank import TrainerRank

    comm, job, roles, role = setup.comm, setup.job, setup.roles, setup.role
    rank = comm.Get_rank()
    mine = setup.groups[role.group]
    turns = gpu_turns(job.layout.share_gpus, binding, setup.run_dir, log=setup.log)
    if job.layout.share_gpus:
        _wait_for_engines(comm, roles["rollout"])
    if turns is not None:  # its allocator keeps out of vLLM's share of the GPU (launch/gpu_share.py)
        cap_trainer_memory(trainer_memory_fraction(job.vllm.gpu_memory_utilization), binding.device)
    t0 = time.time()
    trainer = build_trainer(comm, job, mine, setup.model_paths[job.group_models()[role.group]], binding.device)
    built = time.time()
    if rank == mine[0]:
        from marlaas_hpc.runtime.checkpoint import CheckpointPolicy

        delta = setup.delta_plane().for_leader(comm, binding.device, job.group_models()[role.group])
        worker = TrainerRank(comm, trainer, setup.run_dir, rank, mine[1:], delta, groups=setup.groups,
                             group=role.group, policy=CheckpointPolicy(job.checkpoint), retention=job.adapters,
                             turns=turns)
        worker.clock.note("build_model", (), t0, built)
        _ready(comm, rank, "trainer", setup.start)
        comm.start_heartbeat(worker.clock)
        worker.run_leader()
    else:
        worker = TrainerRank(comm, trainer, setup.run_dir, mine[0], [], groups=setup.groups, group=role.group,
                             retention=job.adapters, turns=turns)
        worker.clock.note("build_model", (), t0, built)
        setup.delta_plane().for_bystander(comm)
        _ready(comm, rank, "trainer", setup.start)
        comm.start_heartbeat(worker.clock)
        worker.run_follower()


def build_trainer(comm, job, trainers: list[int], model_path: Path, device: str):
    """Sets up one trainer group's own torch.distributed world (its TP x DP ranks `trainers`, leader first) from
    MPI, then the trainer on `device` (the rank's binding: its GPU is cuda:0 once CUDA_VISIBLE_DEVICES is
    narrowed)."""
    from marlaas_hpc.runtime.delta.groups import host_store, join_store
    from marlaas_hpc.trainer.trainer import MultiLoraTrainer, TrainerConfig

    leader = trainers[0]
    me = comm.Get_rank()
    store = None
    if len(trainers) > 1:
        if me == leader:
            store, address = host_store(len(trainers))
            for rank in trainers[1:]:
                comm.send(address, dest=rank, tag=21)
        else:
            store = join_store(recv_wait(comm, 21, source=leader)[0], len(trainers))
    # LOCAL_RANK is the rank's CUDA device index, not its index among trainers: each rank sees only its own GPU
    os.environ.update(RANK=str(trainers.index(me)), WORLD_SIZE=str(len(trainers)), LOCAL_RANK="0")
    trainer = MultiLoraTrainer(TrainerConfig(model_path=str(model_path), tensor_parallel=job.layout.trainer_tp,
                                             data_parallel=job.layout.trainer_dp,
                                             expert_parallel=job.layout.trainer_ep, seed=job.seed, device=device,
                                             dtype=job.trainer.dtype, recompute=job.trainer.recompute,
                                             attention=job.trainer.attention,
                                             micro_batch_tokens=job.trainer.micro_batch_tokens), store=store)
    role = assign_role(comm.Get_rank(), job.layout)
    from marlaas_hpc.runtime.checkpoint import role_shard, shard_name

    if shard_name(trainer.tp_rank, trainer.ep_rank) != role_shard(role, job.layout.trainer_ep):  # resume checks those
        raise RuntimeError(f"megatron-core placed trainer rank {comm.Get_rank()} at TP {trainer.tp_rank} / EP "
                           f"{trainer.ep_rank}, the layout at {role_shard(role, job.layout.trainer_ep)}")
    _restore_rng(Path(job.run_dir), trainer.tp_rank, role.group, trainer.dp_rank)
    return trainer


def _restore_rng(run_dir: Path, tp_rank: int, group: int = 0, dp_rank: int = 0) -> None:
    """A resumed trainer rank's random state, as its preemption checkpoint saved it."""
    import torch

    from marlaas_hpc.runtime.checkpoint import set_rng_state, trainer_rng_path

    path = trainer_rng_path(run_dir, tp_rank, group, dp_rank)
    if path.is_file():
        set_rng_state(torch.load(path, map_location="cpu"))


def _ready(comm, rank: int, kind: str, start: float) -> None:
    """Tells rank 0 how long this rank took to get ready (wall and CPU seconds), then waits for every rank."""
    import time

    readiness = (rank, kind, time.time() - start, time.process_time())
    quiet_barrier(comm)  # the rollout ranks are ready last: the others wait here without spinning
    comm.gather(readiness, root=0)


def describe_readiness(readiness: list[tuple[int, str, float, float]]) -> str:
    """'slowest: rollout rank 2 24.1 s (CPU 15.2 s); CPU s per rank: ...' from the ranks' (rank, role, wall,
    CPU) at ready: where a slow start-up goes (on a shared machine the ranks' imports compete for cores)."""
    rank, kind, wall, cpu = max(readiness, key=lambda entry: entry[2])
    per_rank = ", ".join(f"{k} {c:.1f}" for _, k, _, c in sorted(readiness))
    return f"slowest: {kind} rank {rank} {wall:.1f} s, CPU s per rank: {per_rank}"


def _engine_is_up(comm, trainers: list[int]) -> None:
    """Rollout rank, layout.share_gpus: tells every trainer rank that its engine has started."""
    from marlaas_hpc.runtime.messages import TAG_STARTUP

    for rank in trainers:
        comm.send(comm.Get_rank(), dest=rank, tag=TAG_STARTUP)


def _wait_for_engines(comm, rollout_ranks: list[int]) -> None:
    """Trainer rank, layout.share_gpus: waits (sleeping between probes) until every engine has started. vLLM sizes
    its KV cache from the free memory it measures while it profiles at start (gpu_memory_utilization): a trainer
    allocating on the same GPU meanwhile makes it size the cache wrong, or fail its memory check. So under
    share_gpus the trainers build their models after the engines, and start-up takes the sum of the two."""
    from marlaas_hpc.runtime.messages import TAG_STARTUP

    for rank in rollout_ranks:
        recv_wait(comm, TAG_STARTUP, source=rank)
