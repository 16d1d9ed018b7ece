"""Entry point of every rank of a job (under mpirun in local mode, or srun --het-group under Slurm).

    python -m marlaas_hpc.runtime.main CONFIG --run-dir DIR [--mode MODE]
    python -m marlaas_hpc.runtime.main --resume DIR          (continue a preempted or crashed job)

Roles come from assign_role(rank, layout); the world size must equal the layout's. Each rank's device comes
from launch/devices.py (bind_device) and is applied before MPI_Init, which may start CUDA (bind_rank_device).
SIGUSR2 checkpoints every task at a step boundary and ends the job with exit status 75 (runtime/checkpoint.py);
tasks are also checkpointed periodically, so `--resume` continues a crashed job too. A rank that dies of an
exception reports it to the job's supervisor (launch/monitor.py: one message names the rank, its role and the
cause), keeps its traceback in RUN_DIR/crash/rank<N>.txt and aborts the job: every other rank is blocked in MPI
or a collective with it.
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from marlaas_hpc.config import JobConfig
from marlaas_hpc.launch.layout import assign_role, ranks_of, trainer_group_ranks, world_size_matches
from marlaas_hpc.launch.ulfm_slurm import JOIN_SLOT_ENV
from marlaas_hpc.runtime.comm import quiet_barrier, recv_wait
from marlaas_hpc.runtime.quiet import silence_library_notices
from marlaas_hpc.scheduler import MODES
from marlaas_hpc.tasks.spec import SpecError

if TYPE_CHECKING:
    from marlaas_hpc.launch.devices import DeviceBinding


def roles_of(layout) -> dict[str, list[int]]:
    return {kind: list(ranks_of(kind, layout)) for kind in ("env", "rollout", "trainer")}


PREEMPTED_EXIT = 75
"""Exit status of a job that stopped at a checkpoint (EX_TEMPFAIL: run it again with --resume)."""
JOB_FILE = "job.yaml"
"""The config a run dir was started with (overrides applied): what `--resume DIR` runs again."""


def load_job(config_path: str | None, run_dir: str | None, mode: str | None, resume: bool = False) -> JobConfig:
    """The job of a fresh start (CONFIG, with --run-dir/--mode overrides) or of a resume (RUN_DIR/job.yaml
    unless a CONFIG is given)."""
    if config_path is None:
        if not (resume and run_dir):
            raise SpecError("config", "a config file is required (or --resume RUN_DIR)")
        config_path = str(Path(run_dir) / JOB_FILE)
        if not Path(config_path).is_file():
            raise SpecError("resume", f"{run_dir} has no {JOB_FILE}: not a run dir of this tool")
    job = JobConfig.load(config_path)
    if run_dir:
        job.run_dir = run_dir
    if mode:
        job.mode = mode
    return job.validate()


def check_run_dir(job: JobConfig, resume: bool) -> dict | None:
    """A fresh start refuses a run dir holding the checkpoint of an unfinished job (it would mix two jobs'
    outputs); a resume needs one. Returns the checkpoint to resume from."""
    from marlaas_hpc.runtime.checkpoint import checkpoint_file, load_job_checkpoint

    try:
        state = load_job_checkpoint(Path(job.run_dir), warn=lambda message: print(f"marlaas: {message}",
                                                                                 file=sys.stderr))
    except ValueError as exc:
        raise SpecError("resume" if resume else "run_dir", str(exc)) from None
    if resume and state is None:
        raise SpecError("resume", f"{checkpoint_file(job.run_dir)} not found, or its job finished: nothing to "
                                  "resume")
    if not resume and state is not None:
        raise SpecError("run_dir", f"{job.run_dir} holds a checkpoint of an earlier job: resume it with "
                                   f"`marlaas run --resume {job.run_dir}` or choose another run dir")
    return state


def save_job_file(job: JobConfig, config_path: str) -> None:
    import yaml

    data = yaml.safe_load(Path(config_path).read_text()) or {}
    data.update(run_dir=str(Path(job.run_dir).resolve()), mode=job.mode)
    path = Path(job.run_dir) / JOB_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.resolve() != Path(config_path).resolve():
        path.write_text(yaml.safe_dump(data, sort_keys=False))


@dataclass(frozen=True)
class EarlyBinding:
    """What `bind_rank_device` decided before MPI_Init, kept for the check against MPI's placement after it."""

    binding: "DeviceBinding | None"
    """The binding applied, None when refused."""
    refusal: str | None
    """Why the rank cannot get its device (reported by rank 0 once MPI is up)."""
    environ: dict[str, str]
    """The launcher's environment as it was before CUDA_VISIBLE_DEVICES was narrowed."""
    driver_gpus: int
    """GPUs the driver lists on the node."""


def bind_rank_device(job: JobConfig, environ=os.environ) -> EarlyBinding:
    """This rank's device (launch/devices.py), applied BEFORE MPI_Init: a CUDA-aware MPI transport (UCX) may start
    CUDA inside MPI_Init, and CUDA reads CUDA_VISIBLE_DEVICES once, when it starts. MPI is not up yet, so the rank
    and the ranks sharing its node come from the launcher's variables; `check_rank_device` compares them with MPI's
    placement once it is. A refusal is kept, not raised: every rank must reach MPI_Init for rank 0 to report it."""
    from marlaas_hpc.launch.devices import (apply_binding, bind_device, count_driver_gpus, node_ranks_from_env,
                                            world_rank_from_env)

    launcher_env, driver_gpus = dict(environ), count_driver_gpus()
    try:
        binding = bind_device(launcher_env, world_rank_from_env(launcher_env), job.layout, driver_gpus=driver_gpus,
                              node_ranks=node_ranks_from_env(launcher_env))
        apply_binding(binding, environ)
    except (SpecError, RuntimeError, ValueError) as exc:
        return EarlyBinding(None, str(exc), launcher_env, driver_gpus)
    return EarlyBinding(binding, None, launcher_env, driver_gpus)


def check_rank_device(comm, job: JobConfig, early: EarlyBinding) -> str | None:
    """After MPI_Init (collective): the refusal of `bind_rank_device`, or a binding that MPI's placement (world
    rank, and the ranks sharing the node from a shared-memory split, whatever the launcher) would change; None
    when the rank runs on the device it was bound to."""
    from mpi4py import MPI

    from marlaas_hpc.launch.devices import placement_mismatch

    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    node_ranks = node.allgather(comm.Get_rank())
    node.Free()
    if early.refusal is not None:
        return early.refusal
    return placement_mismatch(early.environ, job.layout, early.driver_gpus, early.binding, comm.Get_rank(),
                              node_ranks)


def _log_devices(bindings, log) -> None:
    """Rank 0: every GPU rank's binding, or one line when the whole job runs on the CPU."""
    if bindings is None:
        return
    gpu_roles = [b for b in bindings if b.role in ("rollout", "trainer")]
    if not any(b.is_cuda for b in gpu_roles):
        log(f"[device] every rank on the CPU ({gpu_roles[0].how})")
        return
    for binding in gpu_roles:
        log(f"[device] {binding.describe()}")


def describe_role(role, trainer_groups: int = 1) -> str:
    """A rank's role as the crash message names it."""
    if role.kind != "trainer":
        return role.kind
    group = f" of trainer group {role.group}" if trainer_groups > 1 else ""
    if role.tp_rank == 0:
        return f"trainer leader{group}" if role.dp_rank == 0 else f"trainer leader{group}, DP rank {role.dp_rank}"
    return f"trainer follower{group}, TP rank {role.tp_rank}"


def record_rank(run_dir: Path, rank: int, role: str, **extra) -> None:
    """RUN_DIR/ranks/rank<N>.json: pid and host of each rank of the current run (operators and the fault tests
    find a rank's process here), and `extra` (a joined rank's slot and GPUs under Slurm)."""
    import json

    from marlaas_hpc.rundir import atomic_write_text

    atomic_write_text(Path(run_dir) / "ranks" / f"rank{rank}.json", json.dumps(
        {"rank": rank, "role": role, "pid": os.getpid(), "host": socket.gethostname(), **extra}) + "\n")


def report_crash(exc: BaseException, run_dir: Path, rank: int, reporter) -> None:
    """Keeps the traceback in RUN_DIR/crash/rank<N>.txt and tells the supervisor; without one (a plain
    mpirun), prints the traceback as before."""
    import traceback

    from marlaas_hpc.runtime.faults import describe, is_peer_lost

    text = "".join(traceback.format_exception(exc))
    path = Path(run_dir) / "crash" / f"rank{rank}.txt"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    except OSError:  # the disk may be what failed
        path = None
    if reporter.connected:
        reporter.crash(describe(exc), is_peer_lost(exc), str(path) if path else None)
    else:
        sys.stderr.write(text)
        sys.stderr.flush()


def _trainer(comm, job, trainers: list[int], model_path: Path, device: str):
    """Sets up one trainer group's own torch.distributed world (its TP x DP ranks `trainers`, leader first) from
    MPI, then the trainer on `device` (the rank's binding: its GPU is cuda:0 once CUDA_VISIBLE_DEVICES is
    narrowed)."""
    from marlaas_hpc.runtime.delta import host_store, join_store
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
                                             data_parallel=job.layout.trainer_dp, seed=job.seed, device=device,
                                             dtype=job.trainer.dtype, recompute=job.trainer.recompute,
                                             attention=job.trainer.attention,
                                             micro_batch_tokens=job.trainer.micro_batch_tokens), store=store)
    _restore_rng(Path(job.run_dir), trainer.tp_rank, assign_role(comm.Get_rank(), job.layout).group,
                 trainer.dp_rank)
    return trainer


def _restore_rng(run_dir: Path, tp_rank: int, group: int = 0, dp_rank: int = 0) -> None:
    import torch

    from marlaas_hpc.runtime.checkpoint import trainer_rng_path

    path = trainer_rng_path(run_dir, tp_rank, group, dp_rank)
    if path.is_file():
        torch.set_rng_state(torch.load(path))


def _relay_tier(comm, job: JobConfig, roles: dict, leaders: list[int]):
    """`delta.transport: relay`: the relay tier, collective over the whole job (every rank calls this just before
    the ready barrier; ranks outside the tier get no links); None under the broadcast."""
    if job.delta.transport != "relay":
        return None
    from marlaas_hpc.runtime.relay_plane import job_relay_layout, join_relay_tier

    return join_relay_tier(comm, job_relay_layout(roles["rollout"], leaders, job.delta.relay_fanout,
                                                  job.delta.chunk_elems))


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


def run_rank(comm, job: JobConfig, binding, log=print, preempt=None, resume: dict | None = None) -> dict | None:
    """Sets up this rank's role on its device (`binding`, from bind_rank_device), waits until every rank is ready
    (so TTFS and busy fractions measure the job, not engine start-up), then runs the role's loop. Rank 0
    returns the summary. `resume` (rank 0): the checkpoint this run continues from."""
    import time

    from marlaas_hpc.model import TextCodec

    start = time.time()
    rank = comm.Get_rank()
    role = assign_role(rank, job.layout)
    roles = roles_of(job.layout)
    run_dir = Path(job.run_dir).resolve()
    # every base model's dir by name (rank 0 builds the tiny model / a random checkpoint once), the default first
    model_paths = {name: Path(path) for name, path in comm.bcast(
        {name: str(path) for name, path in job.model_paths().items()} if rank == 0 else None, root=0).items()}
    model_path = next(iter(model_paths.values()))
    codec = TextCodec.from_pretrained(model_path)
    several = len(model_paths) > 1
    # a job of several base models: rank 0 encodes and env ranks decode each task with its model's tokenizer
    model_codecs = ({name: TextCodec.from_pretrained(path) for name, path in model_paths.items()}
                    if several and role.kind in ("scheduler", "env") else None)
    groups = trainer_group_ranks(job.layout)
    leaders = [ranks[0] for ranks in groups]
    leader = leaders[0]
    # a resumed run samples with fresh seeds: replaying an earlier run's seeds would repeat its samples
    restarts = comm.bcast(len(resume["runs"]) + bool(resume.get("current_run")) if resume else 0, root=0)
    seed = job.seed + 100_003 * restarts
    if restarts:  # every trainer rank checks the shards the resume would load (a corrupt one: fall back)
        from marlaas_hpc.runtime.recovery import choose_resume_points

        resume = choose_resume_points(comm, run_dir, resume, roles["trainer"], role.tp_rank, log=log)
    if role.kind == "scheduler":
        from marlaas_hpc.runtime.scheduler_rank import SchedulerRank

        run_dir.mkdir(parents=True, exist_ok=True)
        order = None
        relays = job.delta.transport == "relay"
        if len(leaders) > 1 and not relays:  # the job's order of delta broadcasts: it outlives any trainer group
            from marlaas_hpc.runtime.delta import DeltaOrder

            order = DeltaOrder(comm, leaders)
        _relay_tier(comm, job, roles, leaders)
        quiet_barrier(comm)
        readiness = comm.gather(None, root=0)[1:]
        log(f"[job] all {comm.Get_size()} ranks ready after {time.time() - start:.1f} s "
            f"({describe_readiness(readiness)})")
        scheduler = SchedulerRank(comm, job, roles, codec, run_dir, log=log, startup_s=time.time() - start,
                                  preempt=preempt, resume=resume, model_codecs=model_codecs)
        scheduler.delta_order = order
        comm.start_heartbeat(scheduler.busy)
        return scheduler.run()
    if role.kind == "env":
        from marlaas_hpc.runtime.env_rank import EnvRank

        worker = EnvRank(comm, codec, leader, run_dir=run_dir, pool_config=job.env_pool, sandbox=job.sandbox,
                         group_leaders=leaders, model_codecs=model_codecs)
        _relay_tier(comm, job, roles, leaders)
        _ready(comm, rank, role.kind, start)
        comm.start_heartbeat(worker.clock)
        worker.run()
    elif role.kind == "rollout":
        from marlaas_hpc.runtime.delta import DeltaChannel
        from marlaas_hpc.runtime.delta_fanin import DeltaFanIn
        from marlaas_hpc.runtime.rollout_rank import RolloutRank

        t0 = time.time()
        engine = (model_engines(job, model_paths, rank, seed, binding.device, run_dir) if several else
                  rollout_engine(job, model_path, rank, seed, binding.device, run_dir))
        engine_up = time.time()
        if job.layout.share_gpus:
            _engine_is_up(comm, roles["trainer"])
        # one delta channel per trainer group leader, made in the leaders' order on every rollout rank (each leader
        # waits for its own): each channel's NCCL communicator is set up as it is made, in that one order
        tolerant = comm.members.tolerant
        tier = _relay_tier(comm, job, roles, leaders)
        if tier is not None:
            from marlaas_hpc.runtime.relay_plane import RelayFeed

            delta = RelayFeed(tier, rank, leaders, comm=comm)
        else:
            delta = DeltaFanIn(comm, [DeltaChannel(comm, leader_rank, roles["rollout"], device=binding.device,
                                                   tolerant=tolerant) for leader_rank in leaders],
                               device=binding.device, tolerant=tolerant)
        worker = RolloutRank(comm, engine, delta, seed=seed, run_dir=run_dir, model_dir=model_path,
                             **repack_roles(job, rank, roles["rollout"]))
        worker.clock.note("start_engine", (), t0, engine_up)
        _ready(comm, rank, role.kind, start)
        comm.start_heartbeat(worker.clock)
        worker.run()
    else:
        from marlaas_hpc.runtime.trainer_rank import TrainerRank

        mine = groups[role.group]
        if job.layout.share_gpus:
            _wait_for_engines(comm, roles["rollout"])
        t0 = time.time()
        trainer = _trainer(comm, job, mine, model_paths[job.group_models()[role.group]], binding.device)
        built = time.time()
        if rank == mine[0]:
            from marlaas_hpc.runtime.checkpoint import CheckpointPolicy
            from marlaas_hpc.runtime.delta import DeltaChannel, DeltaOrder

            tier = _relay_tier(comm, job, roles, leaders)
            if tier is not None:
                from marlaas_hpc.runtime.relay_plane import RelayPublisher

                delta = RelayPublisher(tier, rank, comm=comm, tolerant=comm.members.tolerant)
            else:
                order = DeltaOrder(comm, leaders) if len(leaders) > 1 else None
                delta = DeltaChannel(comm, rank, roles["rollout"], device=binding.device, order=order,
                                     tolerant=comm.members.tolerant, model=job.group_models()[role.group])
            worker = TrainerRank(comm, trainer, run_dir, rank, mine[1:], delta, groups=groups, group=role.group,
                                 policy=CheckpointPolicy(job.checkpoint), retention=job.adapters)
            worker.clock.note("build_model", (), t0, built)
            _ready(comm, rank, role.kind, start)
            comm.start_heartbeat(worker.clock)
            worker.run_leader()
        else:
            worker = TrainerRank(comm, trainer, run_dir, mine[0], [], groups=groups, group=role.group,
                                 retention=job.adapters)
            worker.clock.note("build_model", (), t0, built)
            _relay_tier(comm, job, roles, leaders)
            _ready(comm, rank, role.kind, start)
            comm.start_heartbeat(worker.clock)
            worker.run_follower()
    return None


def model_engines(job: JobConfig, model_paths: dict[str, Path], rank: int, seed: int, device: str, run_dir: Path):
    """A rollout rank's engines of a job of several base models: one per model, the first awake
    (rollout/model_engines.py)."""
    from marlaas_hpc.rollout.engine_set import EngineSet
    from marlaas_hpc.rollout.model_engines import ModelEngines

    return ModelEngines(EngineSet({
        name: (lambda path=path, name=name: rollout_engine(job, path, rank, seed, device, run_dir, name))
        for name, path in model_paths.items()}))


def repack_roles(job: JobConfig, rank: int, rollout_ranks: list[int]) -> dict:
    """A rollout rank's part in repack (runtime/repack.py), as RolloutRank's keyword arguments: a tail rank keeps
    the newest (largest max_staleness + 1) versions of every task; the others hand their long tails over."""
    if not job.repack.enabled:
        return {}
    from marlaas_hpc.runtime.repack import Repacker, TailVersions
    from marlaas_hpc.tasks.spec import AlgoSpec

    tails = job.repack.tails(rollout_ranks)
    if rank in tails:
        return {"tail": TailVersions(keep=job.largest_staleness() + 1)}
    group = max((task.algo.group_size for task in job.tasks), default=AlgoSpec().group_size)
    return {"repacker": Repacker(job.repack, job.rollout_slots * group, tails)}


def rollout_engine(job: JobConfig, model_path: Path, rank: int, seed: int, device: str, run_dir: Path,
                   model: str | None = None):
    """A rollout rank's engine, rebuilt in place if it fails (rollout/restart.py). `model`: its name, in a job
    of several (its vLLM work dir)."""
    from marlaas_hpc.launch.slurm_env import compile_cache_dir
    from marlaas_hpc.model.cache import default_cache_dir
    from marlaas_hpc.rollout import make_engine
    from marlaas_hpc.rollout.restart import RestartingEngine

    # compiled-kernel caches persist across runs (a cold inductor cache costs tens of seconds at start); under
    # Slurm on node-local storage, not the home directory's NFS share (compile_cache_dir)
    if job.engine == "vllm":  # vLLM finds its GPUs through CUDA_VISIBLE_DEVICES (all of them: its TP size)
        work_dir = run_dir / "rollout" / f"rank{rank}" / (model or "")
        on_gpu, models = device.startswith("cuda"), len(job.model_names())
        kwargs = {"work_dir": work_dir, "cache_dir": compile_cache_dir(os.environ, default_cache_dir() / "vllm"),
                  **job.vllm.engine_kwargs(job.max_adapters, job.max_lora_rank, job.largest_staleness()),
                  "own_process": job.vllm.own_process(models, on_gpu), "seeded_sampling": job.vllm.seeded(on_gpu)}
        if models > 1 and on_gpu:  # an EngineSet's engines sleep and wake (vLLM's sleep mode, cumem allocator)
            from marlaas_hpc.rollout.engine_set import SLEEP_MODE_KWARGS

            kwargs.update(SLEEP_MODE_KWARGS)
    else:
        kwargs = {"device": device}
        if job.repack.enabled:  # requests cut every step_tokens tokens, so that a tail can be handed over
            kwargs["step_tokens"] = job.repack.step_tokens
    return RestartingEngine(lambda: make_engine(job.engine, model_path, seed=seed + rank, **kwargs))


def join_main(run_dir: str, rank: int) -> None:
    """A rollout rank that joins the live job of `run_dir` as world rank `rank` (started by rank 0:
    runtime/scaling.py): its engine first, then Joining to rank 0, the links its env ranks and trainer leaders
    make to its port, its GPU to each leader (their delta channels are remade with it), and the rollout loop. It
    ends once its links are disconnected (drained, or at the end of the job: a process still linked cannot finalize
    MPI). Devices: under Slurm (launch/ulfm_slurm.py `join`) those of the slot it runs in, bound as that slot's
    rank was (before MPI_Init); in local mode the CPU, or the first GPU it sees."""
    slot = os.environ.get(JOIN_SLOT_ENV)
    binding = _bind_joiner(run_dir, int(slot)) if slot is not None else None
    from mpi4py import MPI  # early: rank 0's MPI_Comm_spawn waits until this process is in MPI_Init

    from marlaas_hpc.launch.monitor import RankReporter
    from marlaas_hpc.model import TextCodec
    from marlaas_hpc.runtime.comm import recv_wait
    from marlaas_hpc.runtime.delta import gpu_key
    from marlaas_hpc.runtime.delta_fanin import DeltaFanIn
    from marlaas_hpc.runtime.membership import LiveComm, Membership, accept_links, open_ports
    from marlaas_hpc.runtime.messages import TAG_CMD, TAG_DELTA, TAG_EVENT, Joining
    from marlaas_hpc.runtime.rollout_rank import RolloutRank

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    job = load_job(None, run_dir, None, resume=True)
    run_path = Path(job.run_dir).resolve()
    live = LiveComm(MPI.COMM_WORLD, Membership(roles_of(job.layout), tolerant=True))
    live.rank = rank
    live.add_link(0, MPI.Comm.Get_parent())
    live.members.join(rank, "rollout")
    role = "rollout (joined)"
    record_rank(run_path, rank, role, **({} if binding is None else {"slot": int(slot), "gpus": list(binding.gpus)}))
    reporter = live.reporter = RankReporter.connect({
        "rank": rank, "role": role, "run_dir": str(run_path), "tolerant": True, "on_rank_loss": "continue",
        "hang_timeout_s": job.fault.hang_timeout_s})
    try:
        import torch

        device = binding.device if binding is not None else \
            "cuda:0" if job.layout.accelerator != "cpu" and torch.cuda.is_available() else "cpu"
        t0 = time.time()
        paths = job.model_paths()  # a job of several base models: one engine per model, as the first ranks
        disk = model_dir = job.model_path()
        planned = t0
        if job.layout.join_weights == "peer":  # one base model only (config.py)
            model_dir, planned = _weights_from_peer(live, rank, run_path, disk)
        weights_in = time.time()
        engine = (model_engines(job, paths, rank, job.seed + 7919 * rank, device, run_path) if len(paths) > 1 else
                  rollout_engine(job, model_dir, rank, job.seed + 7919 * rank, device, run_path))
        engine_up = time.time()
        live.send(Joining(rank), 0, TAG_EVENT)
        peers = recv_wait(live, TAG_CMD, source=0)[0].peers  # LinkTo: who links to it
        ports = open_ports(peers)
        live.send(Joining(rank, ports), 0, TAG_EVENT)
        recv_wait(live, TAG_CMD, source=0)  # its RanksChanged: every peer has been told
        for peer, link in accept_links(ports).items():
            live.add_link(peer, link)
        leaders = [peer for peer in peers if live.members.kind_of.get(peer) == "trainer"]
        if job.delta.transport == "relay":  # its relay comes with the tier re-formed with it (runtime/relay_plane.py)
            from marlaas_hpc.runtime.relay_plane import RelayFeed

            delta = RelayFeed(None, rank, leaders, comm=live)
        else:
            for leader in leaders:  # as every rollout rank does at start: the leader picks the backend
                live.send(gpu_key(torch.device(device)), leader, TAG_DELTA)
            delta = DeltaFanIn(live, [], leaders=leaders, device=device, tolerant=True)
        worker = RolloutRank(live, engine, delta,
                             seed=job.seed + 7919 * rank, run_dir=run_path, model_dir=model_dir)
        if job.layout.join_weights == "peer":  # waiting for the plan (every joiner of its batch asked), then the copy
            worker.clock.note("weights_plan", (), t0, planned)
            worker.clock.note("base_weights", (), planned, weights_in, peer=model_dir != disk)
        worker.clock.note("start_engine", (), weights_in, engine_up)
        live.start_heartbeat(worker.clock)
        worker.run()
        reporter.stop_heartbeat()
        live.disconnect_all()
    except BaseException as exc:
        report_crash(exc, run_path, rank, reporter)
        _remove_local_weights(run_path, rank)
        end_lost_rank()
    reporter.bye()
    _remove_local_weights(run_path, rank)
    end_rank(0)


def _bind_joiner(run_dir: str, slot: int):
    """A joined rank under Slurm: the device binding of world rank `slot` (launch/devices.py, from the slot's
    SLURM_* variables that `ulfm_slurm join` set), applied before MPI_Init as every rank's is."""
    from marlaas_hpc.launch.devices import apply_binding, bind_device, count_driver_gpus, node_ranks_from_env

    job = load_job(None, run_dir, None, resume=True)
    slurm_env = {k: v for k, v in os.environ.items() if not k.startswith("OMPI_COMM_WORLD")}  # its own spawn's
    binding = bind_device(slurm_env, slot, job.layout, driver_gpus=count_driver_gpus(),
                          node_ranks=node_ranks_from_env(slurm_env))
    apply_binding(binding, os.environ)
    return binding


def _weights_from_peer(live, rank: int, run_dir: Path, disk_dir: Path) -> tuple[Path, float]:
    """A joining rank, `layout.join_weights: peer`: the base model's files from a live rollout rank (or the joiner
    before it in a chain) into node-local tmp, forwarded to the next joiner as they come (runtime/peer_weights.py);
    the disk's model directory if rank 0 names no feeder. Returns the directory and when rank 0's plan came."""
    from marlaas_hpc.runtime.comm import recv_wait
    from marlaas_hpc.runtime.membership import accept_links, connect_link, open_port
    from marlaas_hpc.runtime.messages import TAG_CMD, TAG_EVENT, WeightsWanted
    from marlaas_hpc.runtime.peer_weights import WeightSender, local_weights_dir, receive_weights

    port = open_port()
    live.send(WeightsWanted(rank, port), 0, TAG_EVENT)
    plan = recv_wait(live, TAG_CMD, source=0)[0]
    planned = time.time()
    if plan.feeder is None:
        return disk_dir, planned
    feeder = accept_links({plan.feeder: port})[plan.feeder]
    forward = forward_link = None
    if plan.forward_port is not None:
        forward_link = connect_link(plan.forward_port, rank)
        forward = WeightSender(forward_link)
    got = receive_weights(feeder, local_weights_dir(run_dir, rank), disk_dir, forward=forward,
                          feeder=f"rank {plan.feeder}", log=lambda line: print(line, flush=True))
    if got.fell_back is None:
        feeder.Disconnect()
    if forward is not None:
        forward.wait()
        if forward.failed is None:
            forward_link.Disconnect()
    print(f"[join] rank {rank}: base weights from rank {plan.feeder} ({got.peer_bytes / 2**20:.1f} MiB in "
          f"{got.seconds:.1f} s" + (f", then rank {plan.forward_to}" if forward is not None else "") +
          f"; sizes and crc32 checked) in {got.path}", flush=True)
    return got.path, planned


def _remove_local_weights(run_dir: Path, rank: int) -> None:
    import shutil

    from marlaas_hpc.runtime.peer_weights import local_weights_dir

    shutil.rmtree(local_weights_dir(run_dir, rank), ignore_errors=True)


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("config", nargs="?")
    parser.add_argument("--run-dir")
    parser.add_argument("--mode", choices=MODES)
    parser.add_argument("--resume", metavar="RUN_DIR", help="continue the preempted job of RUN_DIR")
    parser.add_argument("--auto-resume", action="store_true",
                        help="resume if the run dir holds a checkpoint, else start fresh (Slurm requeue)")
    parser.add_argument("--join", metavar="RUN_DIR", help=argparse.SUPPRESS)  # a rank rank 0 started
    parser.add_argument("--as-rank", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    silence_library_notices()
    if args.join:
        join_main(args.join, args.as_rank)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from marlaas_hpc.runtime.checkpoint import PreemptFlag, load_job_checkpoint, requeue_marker

    preempt = PreemptFlag.install()  # before anything slow: USR2 must never kill a rank
    run_dir = args.resume or args.run_dir
    resume = bool(args.resume)
    if args.auto_resume and run_dir:
        try:
            resume = load_job_checkpoint(Path(run_dir)) is not None
        except ValueError:
            resume = True  # check_run_dir says what is wrong with it
    job = load_job(args.config, run_dir, args.mode, resume=resume)
    early = bind_rank_device(job)
    from mpi4py import MPI  # MPI_Init: only now, with CUDA_VISIBLE_DEVICES narrowed

    comm = MPI.COMM_WORLD
    check = world_size_matches(job.layout, comm.Get_size())
    if not check:
        return _refuse_start(comm, [check.message])
    state, ok = None, None
    if comm.Get_rank() == 0:
        try:
            job.model_paths()  # a missing checkpoint stops every rank here, naming `model` (or `models.<name>`)
            state = check_run_dir(job, resume)
            if not resume:
                save_job_file(job, args.config)
            requeue_marker(Path(job.run_dir)).unlink(missing_ok=True)
            ok = ""
        except SpecError as exc:
            ok = str(exc)
    quiet_barrier(comm)  # the other ranks wait here while rank 0 checks the run dir and the model
    ok = comm.bcast(ok, root=0)
    if ok:
        return _refuse_start(comm, [ok])
    refused = check_rank_device(comm, job, early)
    binding = early.binding
    refusals = comm.allgather(refused)
    if any(refusals):
        return _refuse_start(comm, list(dict.fromkeys(r for r in refusals if r)))
    log = (lambda message: print(message, flush=True)) if comm.Get_rank() == 0 else (lambda message: None)
    _log_devices(comm.gather(binding, root=0), log)
    from marlaas_hpc.launch.monitor import RankReporter

    rank, run_path = comm.Get_rank(), Path(job.run_dir).resolve()
    role = describe_role(assign_role(rank, job.layout), job.layout.trainer_groups)
    record_rank(run_path, rank, role)
    live = _live_comm(comm, job)
    reporter = live.reporter = RankReporter.connect({
        "rank": rank, "role": role, "run_dir": str(run_path), "max_crash_requeues": job.checkpoint.max_crash_requeues,
        "tolerant": live.members.tolerant, "why_not": live.members.why_not, "on_rank_loss": job.fault.on_rank_loss,
        "hang_timeout_s": job.fault.hang_timeout_s})
    try:
        summary = run_rank(live, job, binding, log=log, preempt=preempt, resume=state)
        reporter.stop_heartbeat()
        if live.members.drained:  # this rank alone left the live job (runtime/scaling.py)
            reporter.bye()
            end_lost_rank()
    except BaseException as exc:
        report_crash(exc, run_path, rank, reporter)
        if live.members.tolerant and rank != 0:
            end_lost_rank()  # the others go on without this rank (runtime/membership.py)
        # one dead rank would leave the others blocked in MPI or a collective: take the whole job down
        comm.Abort(1)
    if summary is not None and not summary["preempted"]:
        log(f"[job] {job.mode} finished in {summary['wall_time_s']:.1f} s; summary: {Path(job.run_dir) / 'summary.json'}")
    live.disconnect_all()  # the links to ranks that joined the live job (runtime/scaling.py)
    _end_barrier(live)
    # only rank 0 reports the preemption: under srun --kill-on-bad-exit an early non-zero exit of another
    # rank would kill rank 0 while it finalizes
    status = PREEMPTED_EXIT if summary is not None and summary["preempted"] else 0
    reporter.bye(status)
    return status


def _refuse_start(comm, messages: list[str]) -> int:
    """Every rank refuses to start (a bad config or run dir, a device the layout cannot have): rank 0 says why, and
    the job ends with status 2. Under the ULFM launcher the status goes through the supervisor (rank 0's bye) and
    every rank exits 0: ULFM's mpiexec sometimes never exited when all of its ranks ended non-zero (a refused
    start hung the job until the test's 300 s timeout, about 1 run in 3)."""
    from marlaas_hpc.launch.monitor import RankReporter
    from marlaas_hpc.launch.mpi import ft_enabled

    if comm.Get_rank() == 0:
        for message in messages:
            print(f"marlaas: {message}", file=sys.stderr, flush=True)
    if not ft_enabled():
        return 2
    reporter = RankReporter.connect({"rank": comm.Get_rank(), "role": "refused"})
    if not reporter.connected:
        return 2  # no supervisor to hear the status: the exit status says it
    reporter.bye(2 if comm.Get_rank() == 0 else None)
    return 0


def _live_comm(comm, job: JobConfig):
    """COMM_WORLD as the roles use it (runtime/membership.py): tolerant of a worker's loss when the job asks for it
    (fault.on_rank_loss: continue) and its MPI can (launch/mpi.py)."""
    from mpi4py import MPI

    from marlaas_hpc.launch.mpi import fault_tolerance_missing
    from marlaas_hpc.runtime.membership import LiveComm, Membership

    wanted = job.fault.on_rank_loss == "continue"
    why_not = fault_tolerance_missing(MPI.Get_library_version()) if wanted else None
    return LiveComm(comm, Membership(roles_of(job.layout), tolerant=wanted and why_not is None, why_not=why_not))


END_BARRIER_S = 30.0
"""A tolerant job's last barrier gives up after this long (a rank lost after rank 0's Shutdown may hold it)."""


def _end_barrier(live) -> None:
    """Ranks leave their loops at different times: the early ones wait without spinning. After a loss there is
    none: a collective among the survivors needs COMM_WORLD shrunk to them, and MPIX_Comm_shrink at the end of a
    job that lost a trainer group hung on every survivor here (its agreement never completed); every rank has
    written its outputs by now, and MPI_Finalize has its deadline (end_rank)."""
    if not live.members.tolerant:
        quiet_barrier(live.world)
        return
    if live.members.ended_lost:  # every survivor takes this branch: rank 0's Shutdown listed the same ranks
        return
    try:
        quiet_barrier(live.world, timeout_s=END_BARRIER_S)
    except Exception as exc:  # a rank lost at the very end: nothing is left to wait for
        if not live.note_failure(exc):
            raise


def end_lost_rank() -> None:
    """A worker that failed in a tolerant job ends at once, without MPI_Finalize (a collective the others reach only
    at the end of the job), and by SIGKILL, not exit(): the runtime reports a killed process failed to its peers
    (0.4 s here), but a process that exits without MPI_Finalize it never reported, and every survivor then waited
    for it in MPI_Finalize for ever (measured with the ULFM Open MPI 5.0.11)."""
    import signal

    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def end_rank(code: int) -> None:
    """Ends this rank's process once every output is written: MPI finalized, stdio flushed, then os._exit. The
    interpreter's own teardown of torch, vLLM and megatron took ~1.3 s per rank (and a rollout rank's orderly
    vLLM shutdown ~0.9 s more), all of it time the job's launcher waited for and none of it freeing anything
    that the exit does not. (Env ranks close their pools and sandbox workers themselves before they get here.)
    A rank that stopped before MPI_Init (a config it could not read) ends without starting MPI."""
    sys.stdout.flush()
    sys.stderr.flush()
    if "mpi4py.MPI" in sys.modules:  # imported = initialized (mpi4py's default)
        from mpi4py import MPI

        from marlaas_hpc.launch.mpi import ft_enabled

        if MPI.Is_initialized() and not MPI.Is_finalized():
            if ft_enabled():
                _finalize_deadline()
            MPI.Finalize()
    os._exit(code)


FINALIZE_DEADLINE_S = 30
"""Under ULFM, how long MPI_Finalize may take before the rank ends without it."""


def _finalize_deadline() -> None:
    """Under ULFM, MPI_Finalize runs an agreement among the survivors, which never ends if a peer left without
    being reported failed (end_lost_rank says how that happened; seen once more, cause unknown, in ~1 run of 4
    after a rollout rank's SIGKILL). Everything is written and said by now, so after FINALIZE_DEADLINE_S the
    kernel ends the rank (SIGALRM's default action: no Python thread can run while MPI_Finalize holds the GIL);
    its peers see it fail, and mpiexec still exits 0 (a lost rank does not change its status under ULFM)."""
    import signal

    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    signal.alarm(FINALIZE_DEADLINE_S)


if __name__ == "__mp_main__":  # a process vLLM spawned from a rank (an engine core of its own): as quiet as the
    silence_library_notices()  # rank, from before it imports vLLM (multiprocessing imports this module first)

if __name__ == "__main__":
    end_rank(main())
