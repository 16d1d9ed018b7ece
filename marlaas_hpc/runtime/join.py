"""A rollout rank that joins the live job (started by rank 0: `marlaas scale`, `layout.rollout_replace`;
runtime/scaling.py), from its process start to its end.

    bind (Slurm: its slot's device) -> MPI_Init -> its engine (base weights from a peer: layout.join_weights)
    -> Joining to rank 0 -> LinkTo: ports for its peers -> RanksChanged: links accepted -> its delta plane
    -> the rollout loop -> links disconnected (drained, or the job's end) -> end_rank
"""
from __future__ import annotations

import os
import time
from pathlib import Path

from marlaas_hpc.launch.devices import apply_binding, joined_binding
from marlaas_hpc.launch.gpu_share import gpu_turns
from marlaas_hpc.launch.ulfm_slurm import JOIN_SLOT_ENV
from marlaas_hpc.runtime.engines import model_engines, rollout_engine
from marlaas_hpc.runtime.process import end_lost_rank, end_rank, load_job, record_rank, report_crash, roles_of


def join_main(run_dir: str, rank: int, gpus: str | None = None) -> None:
    """A rollout rank that joins the live job of `run_dir` as world rank `rank`: its engine first, then Joining to
    rank 0, the links its env ranks and trainer leaders make to its port, its GPU to each leader (their delta
    channels are remade with it), and the rollout loop. It ends once its links are disconnected (drained, or at
    the end of the job: a process still linked cannot finalize MPI). Devices: under Slurm (launch/ulfm_slurm.py
    `join`) those of the slot it runs in, bound as that slot's rank was (before MPI_Init); in local mode the GPUs
    rank 0 gave it (`gpus`: a replacement the dead rank's, another joiner free ones), or the CPU."""
    slot = os.environ.get(JOIN_SLOT_ENV)
    if slot is not None:
        binding = _bind_joiner(run_dir, int(slot))
    else:
        binding = joined_binding(rank, gpus.split(",") if gpus else ())
        apply_binding(binding, os.environ)
    from mpi4py import MPI  # early: rank 0's MPI_Comm_spawn waits until this process is in MPI_Init

    from marlaas_hpc.launch.monitor import RankReporter
    from marlaas_hpc.runtime.membership import LiveComm, Membership

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    job = load_job(None, run_dir, None, resume=True)
    run_path = Path(job.run_dir).resolve()
    live = LiveComm(MPI.COMM_WORLD, Membership(roles_of(job.layout), tolerant=True))
    live.rank = rank
    live.add_link(0, MPI.Comm.Get_parent())
    live.members.join(rank, "rollout")
    role = "rollout (joined)"
    record_rank(run_path, rank, role, gpus=list(binding.gpus), **({} if slot is None else {"slot": int(slot)}))
    reporter = live.reporter = RankReporter.connect({
        "rank": rank, "role": role, "run_dir": str(run_path), "tolerant": True, "on_rank_loss": "continue",
        "hang_timeout_s": job.fault.hang_timeout_s})
    try:
        _serve(live, job, rank, run_path, binding)
        reporter.stop_heartbeat()
        live.disconnect_all()
    except BaseException as exc:
        report_crash(exc, run_path, rank, reporter)
        _remove_local_weights(run_path, rank)
        end_lost_rank()
    reporter.bye()
    _remove_local_weights(run_path, rank)
    end_rank(0)


def _serve(live, job, rank: int, run_path: Path, binding) -> None:
    """The joined rank's life in the job: its engine, its links, its delta plane, then the rollout loop."""
    from marlaas_hpc.runtime.rollout_rank import RolloutRank

    device = binding.device
    t0 = time.time()
    paths = job.model_paths()  # a job of several base models: one engine per model, as the first ranks
    disk = model_dir = job.model_path()
    planned = t0
    if job.layout.join_weights == "peer":  # one base model only (config.py)
        model_dir, planned = _weights_from_peer(live, rank, run_path, disk)
    weights_in = time.time()
    turns = gpu_turns(job.layout.share_gpus, binding, run_path, log=lambda line: print(line, flush=True))
    engine = (model_engines(job, paths, rank, job.seed + 7919 * rank, device, run_path, turns) if len(paths) > 1
              else rollout_engine(job, model_dir, rank, job.seed + 7919 * rank, device, run_path, turns=turns))
    engine_up = time.time()
    leaders = _link_up(live, rank)
    from marlaas_hpc.launch.layout import trainer_group_ranks
    from marlaas_hpc.runtime.delta import delta_plane

    # its end of the delta plane comes with the next remade channels (or tier)
    plane = delta_plane(job.delta, live.members.alive("rollout"),
                        [ranks[0] for ranks in trainer_group_ranks(job.layout)])
    delta = plane.for_joiner(live, rank, leaders, device)
    worker = RolloutRank(live, engine, delta,
                         seed=job.seed + 7919 * rank, run_dir=run_path, model_dir=model_dir)
    if job.layout.join_weights == "peer":  # waiting for the plan (every joiner of its batch asked), then the copy
        worker.clock.note("weights_plan", (), t0, planned)
        worker.clock.note("base_weights", (), planned, weights_in, peer=model_dir != disk)
    worker.clock.note("start_engine", (), weights_in, engine_up)
    live.start_heartbeat(worker.clock)
    worker.run()


def _link_up(live, rank: int) -> list[int]:
    """Joining to rank 0; its LinkTo names the peers that link to this rank, which opens a port for each and
    accepts their links once rank 0's RanksChanged says every peer has been told. Returns the trainer leaders."""
    from marlaas_hpc.runtime.comm import recv_wait
    from marlaas_hpc.runtime.membership import accept_links, open_ports
    from marlaas_hpc.runtime.messages import TAG_CMD, TAG_EVENT, Joining

    live.send(Joining(rank), 0, TAG_EVENT)
    peers = recv_wait(live, TAG_CMD, source=0)[0].peers  # LinkTo: who links to it
    ports = open_ports(peers)
    live.send(Joining(rank, ports), 0, TAG_EVENT)
    recv_wait(live, TAG_CMD, source=0)  # its RanksChanged: every peer has been told
    for peer, link in accept_links(ports).items():
        live.add_link(peer, link)
    return [peer for peer in peers if live.members.kind_of.get(peer) == "trainer"]


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
