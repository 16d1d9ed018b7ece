"""Every message that travels between ranks (pickled by mpi4py), in one module. Control plane: small, to/from rank 0.
Data plane: token arrays worker -> worker (rollout -> env -> trainer), never through rank 0.

The scheduler's events and commands (scheduler/events.py) do not travel as they are: their wire forms are defined
here (the last section, same names and fields), and rank 0 translates at its edge (`to_wire` for each command it
sends, `to_event` for each event it receives). So the pure core can change what it keeps without changing what
travels over MPI; tests/test_wire.py checks each wire form against its scheduler form.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from marlaas_hpc.rollout.base import Generation, GenerationRequest
from marlaas_hpc.tasks.spec import TaskSpec
from marlaas_hpc.trajectory import Trajectory

TAG_CMD = 11
"""rank 0 -> workers: scheduler commands, Shutdown."""
TAG_EVENT = 12
"""workers -> rank 0: scheduler events, EvalDone, RankStats."""
TAG_DATA = 13
"""worker -> worker: GroupTurn (rollout -> env), ContinueGroup / GroupEnded (env -> rollout, multi-turn),
ScoredGroup (env -> trainer)."""
TAG_DELTA = 14
"""trainer leader -> rollout ranks: DeltaAnnounce, followed by a torch.distributed broadcast."""
TAG_TRAINER = 15
"""trainer leader -> other TP ranks: the operation all trainer ranks execute together."""


@dataclass
class PromptGroup:
    group_id: str
    prompt_index: int
    prompt_ids: list[int]
    completion_tokens: list[int] | None = None
    """The exact length of each of this prompt's completions, where its task's kind sets them
    (TaskData.completion_tokens, capped by max_new_tokens: the engine samples that many tokens, stop tokens
    included); None: up to the work's max_new_tokens, ending at a stop token."""


@dataclass
class GenerateWork:
    """A Generate command with the prompts filled in by rank 0 (it owns the task data)."""

    task_id: str
    version: int | None
    env_rank: int
    groups: list[PromptGroup]
    group_size: int
    temperature: float
    max_new_tokens: int
    eval: bool = False
    """Greedy eval pass: one sample per prompt, scored into an accuracy (EvalDone), never trained."""
    multi_turn: bool = False
    """Episodes may go on after the first turn: the rollout rank pins the group's version until its env rank
    sends GroupEnded, and samples every later turn (ContinueGroup) with it."""
    episode_tokens: int | None = None
    """Multi-turn: prompt + model + tool token budget of an episode; every turn's cap is cut to fit it."""
    adapter: str | None = None
    """The name of the task's adapter versions after a rollback (TaskState.adapter_key); None: the task id."""
    model: str | None = None
    """The task's base model (its name in the job's `models`): which engine of a rollout rank that serves
    several samples it (rollout/model_engines.py). None: the rank's one engine."""
    routes: bool = False
    """Routing replay (`algo.routing_replay`): the engine records each position's experts (GroupTurn `routes`)."""

    @property
    def adapter_key(self) -> str:
        return self.adapter or self.task_id


@dataclass
class GroupTurn:
    """One turn of a prompt group's episodes, rollout -> env: turn 1 of all G, or turn t of those that went on."""

    task_id: str
    group_id: str
    prompt_index: int
    version: int | None
    prompt_ids: list[int]
    completions: list[list[int]]
    logprobs: list[list[float]]
    eval: bool = False
    turn: int = 1
    episodes: list[int] | None = None
    """Episode index of each completion (None: 0..G-1, turn 1)."""
    sampled_versions: list[int | None] | None = None
    """Adapter version the engine reports for each completion (must equal `version`: pinned)."""
    newest_version: int | None = None
    """Newest version of the task this rollout rank held when the turn was submitted (newer than `version`
    when a delta arrived mid-episode)."""
    routes: list | None = None
    """Routing replay: each completion's Generation `routes` (int16 [positions fed, MoE layers, k]); None: not
    recorded."""


@dataclass
class ContinueGroup:
    """Env -> rollout: the next turn of these episodes of a group; contexts are prompt + everything so far
    (model turns and tool observations)."""

    group_id: str
    turn: int
    episodes: list[int]
    contexts: list[list[int]]


@dataclass
class GroupEnded:
    """Env -> rollout: every episode of a multi-turn group has ended (or its task failed): unpin its version."""

    group_id: str


@dataclass
class ScoredGroup:
    """Scored trajectories of one group with their advantages, env -> trainer leader."""

    group_id: str
    trajectories: list[Trajectory]


@dataclass
class EvalDone:
    task_id: str
    version: int | None
    accuracy: float
    n: int
    group_id: str = ""
    """The eval prompt's group (rank 0 counts each once: one re-sent after a rank's loss may answer twice)."""


@dataclass
class RankStats:
    rank: int
    kind: str
    busy_s: float
    wall_s: float
    extra: dict = field(default_factory=dict)


@dataclass
class DeltaAnnounce:
    """Task `task_id`'s adapter at `version` follows as one flat fp32 broadcast of these tensors."""

    task_id: str
    version: int
    names: list[str]
    shapes: list[tuple[int, ...]]
    lora: object
    """The task's LoraSpec (rank, alpha, targets) for the PEFT config."""
    seq: int | None = None
    """With several trainer groups: the broadcast's place in the job's one order of delta broadcasts
    (runtime/delta/broadcast.py DeltaOrder), which every rollout rank posts them in. None with one group."""
    epoch: int = 0
    """The channel it is broadcast on (a channel is remade when the rollout ranks change: a lost or joined rank)."""
    model: str | None = None
    """The base model of the trainer group that trained it (layout.trainer_group_models): which engine of a rollout
    rank that serves several models installs it. None: the rank's one engine."""


@dataclass
class Shutdown:
    reason: str = "all tasks ended"
    """'drained': this rank alone leaves (runtime/scaling.py); the job goes on."""
    lost: tuple[int, ...] = ()
    """Every rank the job lost: each survivor takes the same way out (runtime/main.py `_end_barrier`)."""


@dataclass
class RanksChanged:
    """rank 0 -> every live worker (TAG_CMD), before any command that depends on it: ranks lost or joined
    (runtime/membership.py), and the delta plane's rollout members from now on. Each trainer leader and rollout
    rank remakes its delta channels when `delta_epoch` moves on (runtime/delta/broadcast.py)."""

    delta_epoch: int
    rollout_ranks: tuple[int, ...]
    lost: tuple[int, ...] = ()
    left: tuple[int, ...] = ()
    """Those of `lost` that left alive (drained): their links are disconnected, not dropped."""
    joined: tuple[int, ...] = ()
    rolled_back: tuple[str, ...] = ()
    """Tasks of a lost trainer group, going back to their checkpoint: a trainer group holding any of them (one
    handed over from the lost group) drops it; their Admit follows."""
    ports: dict = field(default_factory=dict)
    """Joined rank -> {peer: the MPI port it accepts that peer's link on}: each env rank and trainer leader connects
    to its own (runtime/membership.py connect_link; two connects to one port at once were seen to hang)."""


@dataclass
class DeltaPlaneFailed:
    """trainer leader -> rank 0 (TAG_EVENT): its delta plane of `epoch` could not be set up (a member lost while it
    was remade, runtime/delta/broadcast.py); rank 0 answers with a RanksChanged of a new epoch over the live
    rollout ranks, unless a newer one is under way already."""

    group: int
    epoch: int
    why: str


@dataclass
class Joining:
    """A rank rank 0 started (runtime/scaling.py) -> rank 0: its engine is up (`ports` None), then, once rank 0 said
    which ranks link to it (LinkTo), the port it accepts each one's link on."""

    rank: int
    ports: dict | None = None


@dataclass
class WeightsWanted:
    """A rank rank 0 started, `layout.join_weights: peer` -> rank 0 (TAG_EVENT), before its engine: it takes the
    base weights from a peer, whose link it accepts on `port` (runtime/peer_weights.py)."""

    rank: int
    port: str


@dataclass
class WeightsPlan:
    """rank 0 -> a joiner that asked for the base weights (TAG_CMD): the rank that feeds it (None: read the disk) and
    the port of the next joiner of its chain, which it forwards every chunk to (None: it is the last)."""

    feeder: int | None
    forward_to: int | None = None
    forward_port: str | None = None


@dataclass
class FeedWeights:
    """rank 0 -> a live rollout rank (TAG_CMD): send the base model's files to the joiner `rank`, whose link is
    accepted on `port` (runtime/peer_weights.py PeerFeed)."""

    rank: int
    port: str


@dataclass
class LinkTo:
    """rank 0 -> a rank that joins: the ranks that will link to it (env ranks and trainer leaders)."""

    peers: tuple[int, ...]


@dataclass
class ChannelAddress:
    """trainer leader -> each rollout rank of its new delta channel (TAG_DELTA, after every announce of the
    channel before): where the channel of `epoch` rendezvouses, its backend and members (the leader first)."""

    epoch: int
    address: tuple
    backend: str
    members: tuple[int, ...]


@dataclass
class RelayAddress:
    """the first trainer leader -> every other leader and every rollout rank of a re-formed relay tier (TAG_DELTA;
    runtime/delta/relay_plane.py): where the tier of `epoch` rendezvouses (its TCPStore) and who is who in it (a
    runtime/delta/relay.py RelayTierLayout over the live rollout ranks)."""

    epoch: int
    address: tuple
    layout: object


# ---- trainer operations: a group's leader -> every rank of the group (TAG_TRAINER), run by all in one order ----
class TrainerOp:
    """The same trainer call on every rank of a trainer group. `stage` names its timeline span; a `durable` op
    writes shards, and each follower acknowledges it (runtime/trainer_rank.py `_everyone`)."""

    stage = ""
    durable = False

    def tasks(self) -> list[str]:
        """The tasks it acts on (the timeline's)."""
        return []


@dataclass
class AdmitOp(TrainerOp):
    """Create a task's adapter (v0), or restore it at `admit.resume_version`, and publish it."""

    admit: object
    """The scheduler's Admit."""
    stage = "admit"

    def tasks(self) -> list[str]:
        return [self.admit.spec.task_id]


@dataclass
class TrainOp(TrainerOp):
    """One optimizer step for each order, fused (one shared base forward and backward)."""

    batches: list
    """(Train order, its trajectories) per task."""
    stage = "train"

    def tasks(self) -> list[str]:
        return [order.task_id for order, _ in self.batches]


@dataclass
class SaveOp(TrainerOp):
    """Periodic checkpoint of these tasks' shards (at their versions now)."""

    task_ids: list
    stage, durable = "save", True

    def tasks(self) -> list[str]:
        return list(self.task_ids)


@dataclass
class CheckpointOp(TrainerOp):
    """Preemption: every live task's shards and the RNG."""

    stage, durable = "checkpoint", True


@dataclass
class TaskOp(TrainerOp):
    """An op on one task."""

    task_id: str

    def tasks(self) -> list[str]:
        return [self.task_id]


@dataclass
class RemoveOp(TaskOp):
    """The task ended: drop its adapter (its final version stays on disk)."""

    stage = "remove"


@dataclass
class MoveOutOp(TaskOp):
    """Send the task's shard to the same position of another trainer group (`target_ranks`) and drop it."""

    target_ranks: list
    stage = "move_out"


@dataclass
class MoveInOp(TaskOp):
    """Receive a moving task's shard from the same position of its old group (`source_ranks`). Acknowledged by
    every rank with whether its shard came (it does not when a rank of the old group was lost)."""

    spec: object
    source_ranks: list
    stage, durable = "move_in", True


@dataclass
class ForgetOp(TrainerOp):
    """Drop what this group holds of these tasks (rolled back after another group's loss), nothing written."""

    task_ids: list
    stage = "forget"

    def tasks(self) -> list[str]:
        return list(self.task_ids)


@dataclass
class PublishOp(TrainerOp):
    """Broadcast these tasks' current versions again (a remade delta channel: its new members hold none of
    them, or missed the broadcasts in flight when it was remade); nothing is written."""

    task_ids: list
    stage = "publish"

    def tasks(self) -> list[str]:
        return list(self.task_ids)


@dataclass
class ShutdownOp(TrainerOp):
    """The job ends: followers leave their loop."""

    lost: tuple[int, ...] = ()
    """Shutdown.lost, passed on."""
    stage = "shutdown"


@dataclass
class Checkpoint:
    """rank 0 -> trainer leader, once the drained job is settled: save every live task (all TP ranks)."""

    reason: str = "preempted"


@dataclass
class CheckpointDone:
    """trainer leader -> rank 0: the versions saved, per live task."""

    versions: dict[str, int]


# ---- trainer groups (layout.trainer_groups > 1; runtime/trainer_rank.py, scheduler/placement.py) ----
TAG_HANDOVER = 16
"""trainer leader -> trainer leader: Handover of a task moving between trainer groups."""
TAG_STATE = 17
"""trainer rank -> the rank at the same position of another trainer group: a moving task's state shard."""
TAG_STARTUP = 18
"""rollout rank -> every trainer rank, once at start under layout.share_gpus: its engine is up (runtime/main.py
run_rank: trainers allocate only after every engine has sized its KV cache)."""


@dataclass
class Handover:
    """Old leader -> new leader of a task that moves (scheduler Move, at a step boundary): what the new group
    needs besides the state shards its ranks receive from their counterparts (TAG_STATE)."""

    task_id: str
    version: int
    spec: object
    """The task's TaskSpec."""
    source_ranks: list[int]
    """World ranks of the old group, by position (rank j sends its shard to the new group's rank j)."""
    buffered: dict[str, list[Trajectory]]
    """Scored groups of the task that had reached the old leader and not been trained yet."""
    last_saved: tuple[int, float] | None = None
    """(version, unix time) of the task's last periodic save (CheckpointPolicy), for the new group's policy."""
    adapter_key: str | None = None
    """The name its versions are published under (Admit.adapter_key)."""


@dataclass
class TaskSaved:
    """trainer leader -> rank 0, just before the StepDone of `version`: every TP rank has saved the task's shard
    at that version (a periodic checkpoint); rank 0 records it when it handles that StepDone."""

    task_id: str
    version: int


@dataclass
class EngineRestarted:
    """rollout rank -> rank 0: its engine failed and was replaced; the requests in flight were re-issued."""

    rank: int
    cause: str
    restarts: int
    requests: int


@dataclass
class RepackGroup:
    """A prompt group handed over, rollout rank -> tail rank (TAG_DATA; runtime/repack.py): what its G completions
    have so far."""

    source: int
    work: GenerateWork
    """The group's work (its `groups` just this one)."""
    group: PromptGroup
    version: int
    """The group's pinned adapter version: every continuation names it."""
    done: dict[int, Generation]
    """Episode -> its finished completion."""
    continuations: dict[int, GenerationRequest]
    """Episode -> its request as cut (`partial_ids`, `partial_logprobs`)."""
    newest: int | None
    t0: float
    """When the group started on the source rank."""


# ---- the scheduler's events and commands as they travel (module doc; their meaning: scheduler/events.py) ----
@dataclass(slots=True)
class Generated:
    """rollout rank -> rank 0 (TAG_EVENT): a turn of these groups left the engine, with the versions used."""

    rollout_rank: int
    group_ids: tuple[str, ...]
    versions: tuple[int | None, ...] = ()


@dataclass(slots=True)
class Resumed:
    """rollout rank -> rank 0: a multi-turn group's next turn entered the engine."""

    rollout_rank: int
    group_ids: tuple[str, ...]


@dataclass(slots=True)
class Scored:
    """env rank -> rank 0: a group is scored."""

    group_id: str
    reward_mean: float
    informative: bool = True


@dataclass(slots=True)
class StepDone:
    """trainer leader -> rank 0: `version` is published (v0 at admission; after a step, with its metrics)."""

    task_id: str
    version: int
    metrics: dict = field(default_factory=dict)


@dataclass(slots=True)
class TaskFailed:
    """env rank or trainer leader -> rank 0: the task's own fault."""

    task_id: str
    error: str


@dataclass(slots=True)
class Moved:
    """new trainer leader -> rank 0: the moved task's state has arrived."""

    task_id: str
    trainer_group: int


@dataclass(slots=True)
class Served:
    """rollout rank -> rank 0: its engine of `model` is awake, and what the switch cost."""

    rollout_rank: int
    model: str
    sleep_s: float = 0.0
    wake_s: float = 0.0


@dataclass(slots=True)
class Admit:
    """rank 0 -> every env rank and the owning leader (TAG_CMD): create (or restore) the task's adapter."""

    spec: TaskSpec
    resume_version: int | None = None
    trainer_group: int = 0
    adapter_key: str | None = None


@dataclass(slots=True)
class Train:
    """rank 0 -> the owning leader: one optimizer step from `from_version` over `group_ids`."""

    task_id: str
    from_version: int
    group_ids: tuple[str, ...]
    behaviour_versions: tuple[int, ...]
    bound: int
    trainer_group: int = 0
    in_use_from: int | None = None


@dataclass(slots=True)
class Move:
    """rank 0 -> the old leader and every env rank: the task changes trainer group at a step boundary."""

    task_id: str
    from_group: int
    to_group: int
    version: int


@dataclass(slots=True)
class Discard:
    """rank 0 -> the owning leader: groups that will never be trained."""

    task_id: str
    group_ids: tuple[str, ...]
    reason: str


@dataclass(slots=True)
class TaskEnded:
    """rank 0 -> the owning leader: done, failed or cancelled."""

    task_id: str
    status: str
    error: str | None = None


@dataclass(slots=True)
class Serve:
    """rank 0 -> a rollout rank: serve `model` from now on, then answer Served."""

    rollout_rank: int
    model: str


def _wire_forms() -> dict[type, type]:
    """The scheduler's form -> its wire form, for each event and command that travels."""
    from marlaas_hpc.scheduler import events
    from marlaas_hpc.scheduler import rank_models

    pairs = [(events.Generated, Generated), (events.Resumed, Resumed), (events.Scored, Scored),
             (events.StepDone, StepDone), (events.TaskFailed, TaskFailed), (events.Moved, Moved),
             (rank_models.Served, Served), (events.Admit, Admit), (events.Train, Train), (events.Move, Move),
             (events.Discard, Discard), (events.TaskEnded, TaskEnded), (rank_models.Serve, Serve)]
    return dict(pairs)


WIRE_FORMS = _wire_forms()
"""Scheduler event or command type -> the type that travels."""
SCHEDULER_FORMS = {wire: core for core, wire in WIRE_FORMS.items()}
"""Wire type -> the scheduler's event or command type it stands for."""


def _copy(obj: Any, target: type) -> Any:
    return target(**{spec.name: getattr(obj, spec.name) for spec in dataclasses.fields(target) if spec.init})


def to_wire(command: Any) -> Any:
    """What rank 0 sends for a scheduler command (a message of another type goes as it is)."""
    target = WIRE_FORMS.get(type(command))
    return command if target is None else _copy(command, target)


def to_event(message: Any) -> Any:
    """The scheduler's event for a message rank 0 received (a message of another type stays as it is)."""
    target = SCHEDULER_FORMS.get(type(message))
    return message if target is None else _copy(message, target)
