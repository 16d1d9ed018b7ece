"""Discrete-event simulator: the real `Scheduler` driven by simulated rollout, env and trainer ranks.

    Submit ─► Scheduler.handle ─► commands ─► simulated ranks ─► future events (after stage times) ─► ...

    Generate ─► RolloutSim (continuous batch: every running sequence gains a token per engine step;
                step = decode_step * sequences ** batch_exponent; prefill and adapter loads stall it;
                multi-turn episodes leave the batch for a tool call and come back)
             ─► Generated (scheduler)  +  group data ─► EnvSim (FIFO, reward time per sample) ─► Scored
                (dynamic sampling: informative or not, drawn from the profile's equal_reward_groups)
    Train    ─► TrainerSim of the task's group (fuses every order whose data is there; step time from tokens,
                fused tasks, TP, DP; then publishes each task's delta) ─► StepDone, and the new version on
                every rollout rank
    Admit    ─► TrainerSim of the group the scheduler placed it on (adapter created, v0 published)
                ─► StepDone(v0); evals like the runtime's (the base eval after the task's first Generate)
    Move     ─► the source TrainerSim sends the task's state (adapter + Adam moments) and buffered data to the
                target ─► Moved; the target trains the task only once its state is there

Every scheduler event, submission and eval result first waits its turn at ControlSim, world rank 0, which
handles one at a time at the workload's `control` cost (as measured on the runtime's rank 0); with a free
control plane (all zero) events are handled the moment they arrive.

Injected failures (SimSetup.losses): a lost rollout or env rank stops at once (what it had not finished never
happens, its evals are sent again to a live rank) and the scheduler gets RankLost after a message latency, as
the runtime's rank 0 does from the MPI's failure notice; the scheduler issues the lost groups again.

Only the scheduler's events and commands cross the boundary, so the scheduler cannot tell this from MPI.
Everything random draws from one seeded generator in event order: the same seed gives the same trace.
"""
from __future__ import annotations

import hashlib
import heapq
import itertools
import random
from collections import deque
from dataclasses import dataclass, field

from marlaas_hpc.scheduler import (Admit, Discard, Generate, Generated, Move, Moved, RankLost, Resumed,
                                   Scored, StepDone, Submit, TaskEnded, TaskFailed, Train)
from marlaas_hpc.sim import weight_sync
from marlaas_hpc.sim.driver import SimDriver
from marlaas_hpc.sim.setup import SimSetup
from marlaas_hpc.sim.workload import TaskProfile, Workload


class BusyMeter:
    """Busy seconds of one rank, and its spans (stage, start, end) when a timeline is kept."""

    def __init__(self, keep_spans: bool):
        self.busy = 0.0
        self.spans: list[tuple[str, float, float]] | None = [] if keep_spans else None

    def add(self, stage: str, start: float, end: float) -> None:
        if end > start:
            self.busy += end - start
            if self.spans is not None:
                self.spans.append((stage, start, end))


@dataclass(eq=False)
class SimGroup:
    """A prompt group on its way through rollout and env (training or eval)."""

    task_id: str
    group_id: str
    version: int | None
    env_rank: int
    profile: TaskProfile
    max_tokens: int
    sequences_left: int
    eval: bool = False
    tokens: int = 0
    """Prompt + generated + tool tokens of all its sequences (what the trainer trains on)."""
    in_engine: int = 0
    """Its sequences in the engine (running or queued for room). A group holds a rollout slot while any is: at 0
    its turn left the engine (Generated: the slot is free while tools run); a sequence back from its tool call
    takes the slot again (Resumed), as the runtime counts slots."""


@dataclass(eq=False, slots=True)
class Sequence:
    group: SimGroup
    turns_left: int
    need: float = 0.0
    """Engine-token counter value at which the current turn's decoding completes."""


class RolloutSim:
    """One rollout rank. Continuous batching as processor sharing: all running sequences advance one token
    per step, so a counter of tokens-per-sequence (`tokens`) and a heap of each sequence's finishing count
    give the next completion in O(log n). Prefill and adapter loads stall decoding (`stall_until`)."""

    def __init__(self, sim: "Simulation", rank: int):
        self.sim, self.rank = sim, rank
        self.model = sim.workload.rollout
        self.versions: dict[str, int] = {}
        self.waiting: list[tuple[SimGroup, int]] = []
        """(group, version asked for) whose adapter version has not arrived yet."""
        self.queue: list[Sequence] = []
        """Sequences waiting for room in the running batch."""
        self.running: list[tuple[float, int, Sequence]] = []
        self.tokens = 0.0
        self.last = 0.0
        self.stall_until = 0.0
        self.wakeup = None
        self.wakeup_at = 0.0
        """When the pending wake-up (token `wakeup`) fires."""
        self.meter = BusyMeter(sim.keep_timeline)
        self._seq = itertools.count()
        self.dead = False
        """Lost (an injected failure): it takes and finishes nothing more."""

    # ---- work in ----
    def receive(self, group: SimGroup, asked: int | None) -> None:
        if self.dead:
            return
        if asked is not None and not group.eval and self.versions.get(group.task_id, -1) < asked:
            self.waiting.append((group, asked))
            if self.sim.delta_plane is not None:  # a relay pulling on demand fetches it now
                self.sim.delta_plane.wanted(self.rank, group.task_id, asked)
            return
        if asked is not None and not group.eval:
            group.version = self.versions[group.task_id]  # newest version here (never older than asked)
        self._start_turns(group)

    def _start_turns(self, group: SimGroup) -> None:
        rng, profile = self.sim.rng, group.profile
        prompt = round(profile.prompt_tokens.sample(rng))
        group.tokens += prompt * group.sequences_left
        group.in_engine = group.sequences_left
        self._prefill(prompt * group.sequences_left)
        for _ in range(group.sequences_left):
            self._enter(Sequence(group, profile.turns if not group.eval else 1))
        self._schedule()

    def new_version(self, task_id: str, version: int, transfer_s: float) -> None:
        """A published adapter version arrives: receiving and installing it stalls the engine."""
        self._stall(transfer_s + self.model.adapter_load, "load_delta")
        self.versions[task_id] = max(version, self.versions.get(task_id, -1))
        if not self.waiting:
            return
        ready = [(g, v) for g, v in self.waiting if g.task_id == task_id and v <= version]
        if ready:
            self.waiting = [(g, v) for g, v in self.waiting if not (g.task_id == task_id and v <= version)]
            for group, asked in ready:
                self.receive(group, asked)

    def busy_now(self) -> bool:
        return bool(self.running) or self.stall_until > self.sim.queue.now

    def stop(self) -> None:
        """The rank is lost: what it held is gone, and its pending wake-up finds nothing."""
        self._advance()
        self.waiting, self.queue, self.running, self.wakeup = [], [], [], None
        self.dead = True

    def join_wait(self) -> float:
        """How long a broadcast waits for this rank to join: the rank joins between engine steps, so a
        running engine makes it wait for the rest of the current step."""
        if not self.running or self.stall_until > self.sim.queue.now:
            return 0.0
        step = self._step_time(len(self.running)) + self.model.step_overhead
        return self.sim.rng.uniform(0.0, 2 * self.model.join_wait_steps * step)

    # ---- the engine ----
    def _step_time(self, sequences: int) -> float:
        return self.model.decode_step * sequences ** self.model.batch_exponent

    def _advance(self) -> None:
        """Brings the token counter and the busy time up to now."""
        now = self.sim.queue.now
        start = self.last if self.last > self.stall_until else self.stall_until
        if self.running and now > start:
            per_token = self._step_time(len(self.running))
            overhead = self.model.step_overhead
            self.tokens += (now - start) / (per_token + overhead)
            self.meter.add("generate", start, start + (now - start) * per_token / (per_token + overhead))
        self.last = now

    def _stall(self, seconds: float, stage: str) -> None:
        if seconds <= 0:
            return
        self._advance()
        now = self.sim.queue.now
        begin = now if now > self.stall_until else self.stall_until
        self.stall_until = begin + seconds
        self.meter.add(stage, begin, self.stall_until)
        if self.wakeup is None:  # a stall only delays completions: a pending wake-up is early enough
            self._schedule()

    def _prefill(self, tokens: int) -> None:
        self._stall(tokens * self.model.prefill_per_token, "generate")

    def _enter(self, sequence: Sequence) -> None:
        if len(self.running) >= self.model.max_running_sequences:
            self.queue.append(sequence)
            return
        self._advance()
        length = max(1, round(min(sequence.group.profile.response_tokens.sample(self.sim.rng),
                                  sequence.group.max_tokens)))
        sequence.group.tokens += length
        sequence.need = self.tokens + length
        heapq.heappush(self.running, (sequence.need, next(self._seq), sequence))

    def _schedule(self) -> None:
        """Makes sure a wake-up comes by the next sequence's completion. A pending one that comes no later is
        kept (it finds nothing finished and schedules again): every adapter broadcast stalls every engine, and
        re-filing each engine's wake-up per stall was most of a large simulation's events."""
        if not self.running:
            return
        now, stall_until = self.sim.queue.now, self.stall_until
        per_token = self._step_time(len(self.running)) + self.model.step_overhead
        left = self.running[0][0] - self.tokens
        when = (stall_until if stall_until > now else now) + (left * per_token if left > 0 else 0.0)
        if self.wakeup is not None and self.wakeup_at <= when:
            return
        self.wakeup, self.wakeup_at = (token := object()), when
        self.sim.queue.at(when, self._wake, token)

    def _wake(self, token) -> None:
        if token is not self.wakeup:
            return  # superseded by an earlier wake-up
        self.wakeup = None
        self._advance()
        finished = []
        while self.running and self.running[0][0] <= self.tokens + 1e-9:
            finished.append(heapq.heappop(self.running)[2])
        while self.queue and len(self.running) < self.model.max_running_sequences:
            self._enter(self.queue.pop(0))
        for sequence in finished:
            self._turn_done(sequence)
        self._schedule()

    def _turn_done(self, sequence: Sequence) -> None:
        group = sequence.group
        group.in_engine -= 1
        if group.in_engine == 0:
            self.sim.group_left_engine(self.rank, group)
        sequence.turns_left -= 1
        if sequence.turns_left > 0:  # a tool call, then the next turn continues the episode
            rng = self.sim.rng
            self.sim.queue.after(group.profile.tool_latency.sample(rng), self._tool_returns, sequence,
                                 round(group.profile.tool_output_tokens.sample(rng)))
            return
        group.sequences_left -= 1
        if group.sequences_left == 0:
            self.sim.group_generated(self.rank, group)

    def _tool_returns(self, sequence: Sequence, tool_tokens: int) -> None:
        if self.dead:
            return
        if sequence.group.in_engine == 0:
            self.sim.group_resumed(self.rank, sequence.group)
        sequence.group.in_engine += 1
        sequence.group.tokens += tool_tokens
        self._prefill(tool_tokens)
        self._enter(sequence)
        self._schedule()


class StaticRolloutSim(RolloutSim):
    """HF-generate engine: one batch at a time of everything queued, as long as its longest row."""

    def _enter(self, sequence: Sequence) -> None:
        self.queue.append(sequence)
        if self.wakeup is None:
            self.wakeup = True
            self.sim.queue.at(max(self.sim.queue.now, self.stall_until), self._run_batch)

    def _prefill(self, tokens: int) -> None:
        pass  # part of the batch below

    def join_wait(self) -> float:
        return max(0.0, self.stall_until - self.sim.queue.now)  # the whole batch in progress

    def busy_now(self) -> bool:
        return self.stall_until > self.sim.queue.now

    def _stall(self, seconds: float, stage: str) -> None:
        begin = max(self.sim.queue.now, self.stall_until)
        self.stall_until = begin + seconds
        self.meter.add(stage, begin, self.stall_until)

    def _run_batch(self) -> None:
        if self.dead:
            return
        if self.sim.queue.now < self.stall_until:  # a delta load came in first
            self.sim.queue.at(self.stall_until, self._run_batch)
            return
        batch, self.queue = self.queue[: self.model.max_running_sequences], self.queue[self.model.max_running_sequences:]
        lengths = []
        for sequence in batch:
            length = max(1, round(min(sequence.group.profile.response_tokens.sample(self.sim.rng),
                                      sequence.group.max_tokens)))
            sequence.group.tokens += length
            lengths.append(length)
        seconds = max(lengths) * (self._step_time(len(batch)) + self.model.step_overhead)
        self.meter.add("generate", self.sim.queue.now, self.sim.queue.now + seconds)
        self.stall_until = self.sim.queue.now + seconds
        self.sim.queue.after(seconds, self._batch_done, batch)

    def _batch_done(self, batch: list[Sequence]) -> None:
        if self.dead:
            return
        self.wakeup = None
        for sequence in batch:
            self._turn_done(sequence)
        if self.queue:
            self.wakeup = True
            self._run_batch()


class EnvSim:
    """One env rank: scores groups first come, first served."""

    def __init__(self, sim: "Simulation", rank: int):
        self.sim, self.rank = sim, rank
        self.free_at = 0.0
        self.meter = BusyMeter(sim.keep_timeline)

    def score(self, group: SimGroup, samples: int, rollout_rank: int) -> None:
        env, sim = self.sim.workload.env, self.sim
        seconds = env.group_overhead + sum(env.reward_per_sample.sample(sim.rng) for _ in range(samples))
        # contention with the ranks the group shares a host with
        if env.rollout_contention and sim.rollout[rollout_rank].busy_now():
            seconds += env.rollout_contention
        if env.trainer_contention and sim.trainers[sim.scheduler.trainer_group(group.task_id)].training:
            seconds += env.trainer_contention
        start = max(self.sim.queue.now, self.free_at)
        self.free_at = start + seconds
        self.meter.add("score", start, self.free_at)
        self.sim.queue.at(self.free_at, self.sim.group_scored, group)


class TrainerSim:
    """One trainer group (DP x TP GPUs). Like the runtime's leader: hands over tasks that move away first, then
    one admission and one fused step (over every order whose groups have all arrived and whose task's state is
    here) take turns; each trained task's new version is then published."""

    def __init__(self, sim: "Simulation", index: int):
        self.sim, self.index = sim, index
        self.model = sim.workload.trainer
        self.tp, self.dp = sim.setup.trainer_tp, sim.setup.trainer_dp
        self.admits: deque[Admit] = deque()
        self.moves: list[Move] = []
        """Tasks to hand over to another group (at their step boundary)."""
        self.incoming: set[str] = set()
        """Tasks moving here whose state has not arrived yet."""
        self.orders: list[Train] = []
        self.arrived: dict[str, tuple[str, int]] = {}
        """Group id -> (task id, trained tokens), for groups whose data reached the trainer."""
        self.busy_until = 0.0
        self.working = False
        self.training = False
        """Working on a train step (not an admit): what env contention is fitted against."""
        self.broadcasts = 0
        self.admit_turn = True
        """Admissions and fused steps alternate while both wait (the runtime leader runs one admission per turn
        of its loop)."""
        self.meter = BusyMeter(sim.keep_timeline)

    def _speed(self, seconds: float) -> float:
        return seconds * self.tp ** -self.model.tp_exponent

    def next_job(self) -> None:
        if self.working:
            return
        if self.moves:
            self._move_out(self.moves.pop(0))
            return
        ready = [o for o in self.orders if all(g in self.arrived for g in o.group_ids)]
        if self.incoming:
            ready = [o for o in ready if o.task_id not in self.incoming]
        if self.admits and (self.admit_turn or not ready):
            self.admit_turn = False
            self._admit(self.admits.popleft())
        elif ready:
            self.admit_turn = True
            self._train(ready)

    def _admit(self, admit: Admit) -> None:
        now = self.sim.queue.now
        created = self._on_gpu(self._speed(self.model.admit), "admit")
        done = created + self.sim.publish(admit.spec.task_id, 0, created, self)
        self._busy(now, done, "admit")
        self.sim.queue.at(done + self.sim.latency, self.sim.scheduler_event, StepDone(admit.spec.task_id, 0))

    def _move_out(self, move: Move) -> None:
        """Sends the task's state (adapter + two Adam moments, every rank to its counterpart at once) and the
        data buffered for it to the target group, which then answers Moved."""
        now = self.sim.queue.now
        net = self.sim.workload.network
        state_bytes = 3 * net.adapter_bytes_per_rank * self.sim.task_spec(move.task_id).lora.rank
        end = now + state_bytes / net.delta_bandwidth
        buffered = {g: entry for g, entry in self.arrived.items() if entry[0] == move.task_id}
        for group_id in buffered:
            del self.arrived[group_id]
        self._busy(now, end, "move")
        self.sim.queue.at(end + self.sim.latency, self.sim.trainers[move.to_group].move_in, move, buffered)

    def move_in(self, move: Move, buffered: dict) -> None:
        self.incoming.discard(move.task_id)
        self.arrived.update(buffered)
        self.sim.queue.after(self.sim.latency, self.sim.scheduler_event, Moved(move.task_id, move.to_group))
        self.next_job()

    def _train(self, ready: list[Train]) -> None:
        now = self.sim.queue.now
        taken = {id(o) for o in ready}
        self.orders = [o for o in self.orders if id(o) not in taken]
        step_tokens = [sum(self.arrived.pop(g)[1] for g in o.group_ids) for o in ready]
        tokens = sum(step_tokens)
        decoding = sum(1 for r in self.sim.rollout.values() if r.busy_now()) / len(self.sim.rollout)
        compute = self._speed(self.model.step_fixed + self.model.per_token * tokens / self.dp
                              + self.model.per_task * len(ready) + self.model.overlap_cost * decoding)
        end = self._on_gpu(compute, "train") + self._all_reduce(ready)
        for order in ready:
            end += self.sim.publish(order.task_id, order.from_version + 1, end, self)
        self._busy(now, end, "train")
        self.sim.fused_steps.append(len(ready))
        for order, order_tokens in zip(ready, step_tokens):
            self.sim.queue.at(end + self.sim.latency, self.sim.scheduler_event,
                              StepDone(order.task_id, order.from_version + 1, {"step_tokens": order_tokens}))

    def _on_gpu(self, seconds: float, stage: str) -> float:
        """Runs `seconds` of the group's GPU work (an admission, a step's compute) from now; returns when it ends.
        The group's own GPUs are free whenever it works; tools/studies/multiplex.py's pooled trainers share theirs."""
        return self.sim.queue.now + seconds

    def _all_reduce(self, ready: list[Train]) -> float:
        """DP > 1: the fused tasks' LoRA gradients (each rank's shard) all-reduced over the DP replicas, a ring
        moving 2 (dp - 1) / dp of them at the delta bandwidth."""
        if self.dp == 1:
            return 0.0
        net = self.sim.workload.network
        grad_bytes = sum(net.adapter_bytes_per_rank * self.sim.task_spec(o.task_id).lora.rank for o in ready)
        return 2 * (self.dp - 1) / self.dp * grad_bytes / net.delta_bandwidth

    def _busy(self, start: float, end: float, stage: str) -> None:
        self.working, self.training = True, stage == "train"
        self.meter.add(stage, start, end)
        self.sim.queue.at(end, self._idle)

    def _idle(self) -> None:
        self.working = self.training = False
        self.next_job()


class ControlSim:
    """World rank 0 (workload `control`): one thing at a time. An event, a submission or an eval result waits
    while rank 0 is busy, then takes its cost; an event's commands go out when its handling ends. As the
    runtime's loop does, a submission of the job's starting tasks alternates with an event."""

    def __init__(self, sim: "Simulation"):
        self.sim, self.model = sim, sim.workload.control
        self.submissions: deque = deque()
        self.waiting: deque = deque()
        self.busy = False
        self.submission_turn = True
        self.meter = BusyMeter(sim.keep_timeline)

    def receive(self, cost: float, callback, *args, submission: bool = False) -> None:
        (self.submissions if submission else self.waiting).append((cost, callback, args))
        if not self.busy:
            self._next()

    def _next(self) -> None:
        take_submission = bool(self.submissions) and (self.submission_turn or not self.waiting)
        if not take_submission and not self.waiting:
            self.busy = False
            return
        cost, callback, args = (self.submissions if take_submission else self.waiting).popleft()
        self.submission_turn = not take_submission
        self.busy = True
        now = self.sim.queue.now
        self.meter.add("admit" if take_submission else "event", now, now + cost)
        self.sim.queue.after(cost, self._done, callback, args)

    def _done(self, callback, args) -> None:
        callback(*args)
        self._next()


@dataclass
class SimOutcome:
    end_time: float
    scheduler_events: int
    trace_hash: str
    busy_fraction: dict[str, float]
    ended: dict[str, str] = field(default_factory=dict)


class Simulation(SimDriver):
    """One job: the scheduler (SimDriver) against rollout, env and trainer ranks costed by `workload`."""

    def __init__(self, setup: SimSetup, workload: Workload, seed: int = 0, keep_timeline: bool = False,
                 trace: bool = True, delta_plane: weight_sync.DeltaPlaneModel | None = None,
                 rollout_engine: type | None = None):
        """`delta_plane`: model publishes with sim/weight_sync.py's lockstep broadcast or relay tier instead of the
        averaged broadcast (`publish`); `rollout_engine`: a RolloutSim subclass (e.g. the meter of
        tools/studies/tails.py)."""
        self.setup, self.workload = setup.validate(), workload
        super().__init__(setup.scheduler_config())
        self.rng = random.Random(seed)
        self.keep_timeline = keep_timeline
        self.latency = workload.network.message_latency
        ranks = setup.world_ranks()
        engine = rollout_engine or (RolloutSim if workload.rollout.batching == "continuous" else StaticRolloutSim)
        self.rollout = {rank: engine(self, rank) for rank in ranks["rollout"]}
        self.env = {rank: EnvSim(self, rank) for rank in ranks["env"]}
        self.trainers = [TrainerSim(self, i) for i in range(setup.trainer_groups)]
        self.control = ControlSim(self)
        self._specs = {spec.task_id: spec for spec in setup.tasks}
        self._groups: dict[str, SimGroup] = {}
        self._eval_turn = 0
        self.pending_evals = 0
        self._base_evals_due: set[str] = set()
        """Admitted tasks whose base eval goes out with their first Generate (as the runtime's rank 0 does)."""
        self._broadcasts = 0
        self.fused_steps: list[int] = []
        self.end_time: float | None = None
        self._hash = hashlib.sha256() if trace else None
        self.lost: set[int] = set()
        self.ranks_lost: list[dict] = []
        """Each injected loss: rank, role, when, the groups the scheduler issued again."""
        self._eval_out: dict[str, tuple[SimGroup, int]] = {}
        """Eval group -> (group, rollout rank) until scored (sent again if its rank is lost)."""
        self.delta_plane = weight_sync.delta_plane(self, delta_plane) if delta_plane is not None else None

    # ---- scheduler boundary ----
    def scheduler_event(self, event) -> None:
        """An event reaches rank 0: handled now if the control plane is free, else in its turn at ControlSim."""
        model = self.control.model
        if model.free():
            self._handle(event)
        elif isinstance(event, Submit):
            self.control.receive(model.admit, self._handle, event, submission=True)
        else:
            self.control.receive(model.per_event, self._handle, event)

    def _handle(self, event) -> None:
        self.deliver(event)
        self._check_end()

    def _handled(self, event, commands: list) -> None:
        if self._hash is not None:
            self._hash.update(_describe(self.queue.now, event, commands).encode())
        if isinstance(event, RankLost):
            self.ranks_lost.append({"rank": event.rank, "role": event.role, "at": self.queue.now,
                                    "groups_reissued": [g for c in commands if isinstance(c, Discard)
                                                        for g in c.group_ids]})

    def _execute(self, command) -> None:
        if isinstance(command, Generate):
            self.queue.after(self.latency, self._deliver_generate, command)
            if command.task_id in self._base_evals_due:
                self._base_evals_due.discard(command.task_id)
                self._eval(command.task_id, None)
        elif isinstance(command, Train):
            trainer = self.trainers[command.trainer_group]
            trainer.orders.append(command)
            self.queue.after(self.latency, trainer.next_job)
        elif isinstance(command, Admit):
            trainer = self.trainers[command.trainer_group]
            trainer.admits.append(command)
            self.queue.after(self.latency, trainer.next_job)
            self._base_evals_due.add(command.spec.task_id)
        elif isinstance(command, Discard):
            for group_id in command.group_ids:
                for trainer in self.trainers:  # a moving task's data may still sit in its old group
                    trainer.arrived.pop(group_id, None)
                self._groups.pop(group_id, None)
        elif isinstance(command, Move):
            self.trainers[command.to_group].incoming.add(command.task_id)
            source = self.trainers[command.from_group]
            source.moves.append(command)
            self.queue.after(self.latency, source.next_job)
        elif isinstance(command, TaskEnded):
            if command.status == "done":
                self._eval(command.task_id, self.scheduler.tasks[command.task_id].version)
        else:
            raise TypeError(f"unknown command {command!r}")

    def task_spec(self, task_id: str):
        return self._specs[task_id]

    def _deliver_generate(self, command: Generate) -> None:
        spec = self._specs[command.task_id]
        profile = self.workload.profile(spec.dataset.kind)
        for group_id, _ in command.groups:
            group = SimGroup(command.task_id, group_id, command.version, command.env_rank, profile,
                             spec.algo.max_new_tokens, spec.algo.group_size)
            self._groups[group_id] = group
            self.rollout[command.rollout_rank].receive(group, command.version)

    def _eval(self, task_id: str, version: int | None) -> None:
        """The runtime's greedy eval: eval_size one-sample groups on one rollout rank and one env rank."""
        if not self.workload.evals:
            return
        spec = self._specs[task_id]
        rollout, env = self._eval_ranks()
        profile = self.workload.profile(spec.dataset.kind)
        for i in range(spec.dataset.eval_size):
            self.pending_evals += 1
            group = SimGroup(task_id, f"{task_id}/eval{i}-{version}", version, env, profile,
                             spec.algo.max_new_tokens, 1, eval=True)
            self._send_eval(group, rollout)

    def _eval_ranks(self) -> tuple[int, int]:
        rollouts = sorted(r for r in self.rollout if r not in self.lost)
        envs = sorted(r for r in self.env if r not in self.lost)
        turn, self._eval_turn = self._eval_turn, self._eval_turn + 1
        return rollouts[turn % len(rollouts)], envs[turn % len(envs)]

    def _send_eval(self, group: SimGroup, rollout: int) -> None:
        self._eval_out[group.group_id] = (group, rollout)
        self.queue.after(self.latency, self.rollout[rollout].receive, group, group.version)

    # ---- injected failures ----
    def _lose(self, rank: int, role: str) -> None:
        """The rank stops now; the scheduler hears of it a message latency later."""
        self.lost.add(rank)
        if role == "rollout":
            self.rollout[rank].stop()
        for group_id, (group, rollout) in list(self._eval_out.items()):
            if rank in (rollout, group.env_rank):
                rollout, env = self._eval_ranks()
                again = SimGroup(group.task_id, group.group_id, group.version, env, group.profile, group.max_tokens,
                                 1, eval=True)
                self._send_eval(again, rollout)
        self.queue.after(self.latency, self.scheduler_event, RankLost(rank, role))

    # ---- worker -> worker ----
    def group_left_engine(self, rollout_rank: int, group: SimGroup) -> None:
        """None of the group's sequences is in the engine: its rollout slot is free."""
        if not group.eval and rollout_rank not in self.lost:
            self.queue.after(self.latency, self.scheduler_event,
                             Generated(rollout_rank, (group.group_id,), (group.version,)))

    def group_resumed(self, rollout_rank: int, group: SimGroup) -> None:
        """A sequence of the group is back from its tool call: the group takes a rollout slot again."""
        if not group.eval and rollout_rank not in self.lost:
            self.queue.after(self.latency, self.scheduler_event, Resumed(rollout_rank, (group.group_id,)))

    def group_generated(self, rollout_rank: int, group: SimGroup) -> None:
        """Every turn of the group is done: its data goes to scoring."""
        if rollout_rank in self.lost or group.env_rank in self.lost:
            return
        samples = 1 if group.eval else self._specs[group.task_id].algo.group_size
        self.queue.after(self.latency, self.env[group.env_rank].score, group, samples, rollout_rank)

    def group_scored(self, group: SimGroup) -> None:
        if group.env_rank in self.lost:
            return  # its env rank was lost before it finished
        if group.eval:
            if self._eval_out.get(group.group_id, (None,))[0] is group:  # not sent again meanwhile
                del self._eval_out[group.group_id]
                self.queue.after(self.latency, self._eval_done)
            return
        self.queue.after(self.latency, self.scheduler_event, Scored(group.group_id, 0.0, self._informative(group)))
        if self._groups.pop(group.group_id, None) is not None:
            self.queue.after(self.latency, self._data_arrives, group)

    def _informative(self, group: SimGroup) -> bool:
        """Whether the group's rewards differ: drawn (profile.equal_reward_groups) only for a task with dynamic
        sampling, so that the draws, and the traces, of every other job stay as they were."""
        if not self._specs[group.task_id].algo.filters_groups:
            return True
        return self.rng.random() >= group.profile.equal_reward_groups

    def _data_arrives(self, group: SimGroup) -> None:
        """To the group that owns the task now (the runtime's old owner forwards what reaches it late)."""
        trainer = self.trainers[self.scheduler.trainer_group(group.task_id)]
        trainer.arrived[group.group_id] = (group.task_id, group.tokens)
        trainer.next_job()

    def _eval_done(self) -> None:
        if self.control.model.free():
            self._eval_counted()
        else:
            self.control.receive(self.control.model.eval_result, self._eval_counted)

    def _eval_counted(self) -> None:
        self.pending_evals -= 1
        self._check_end()

    def publish(self, task_id: str, version: int, at: float, trainer: TrainerSim) -> float:
        """Checkpoint + delta broadcast of one version; returns its duration on the trainer. The broadcast
        starts once every rollout rank joins (between engine steps); receiving and installing it stalls each
        rollout rank. A replica's first broadcasts also set its communicator up; the rollout ranks pay that
        once per job (with several replicas they would set the groups up together)."""
        if self.delta_plane is not None:
            return self.delta_plane.publish(task_id, version, at, trainer)
        net, model = self.workload.network, self.workload.trainer
        transfer = net.delta_latency + net.adapter_bytes_per_rank * self._specs[task_id].lora.rank / net.delta_bandwidth
        setup = model.broadcast_setup if trainer.broadcasts < model.warm_up_broadcasts else 0.0
        rollout_setup = model.broadcast_setup if self._broadcasts == 0 else 0.0
        trainer.broadcasts += 1
        self._broadcasts += 1
        start = at + model.publish_fixed + max(rollout.join_wait() for rank, rollout in self.rollout.items()
                                               if rank not in self.lost)
        self.queue.at(start, self._version_arrives, task_id, version, transfer + rollout_setup)
        return start - at + setup + transfer

    def _version_arrives(self, task_id: str, version: int, transfer: float) -> None:
        for rank, rollout in self.rollout.items():
            if rank not in self.lost:
                rollout.new_version(task_id, version, transfer)

    # ---- run ----
    def _check_end(self) -> None:
        if self.end_time is None and self.pending_evals == 0 and self.scheduler.finished() and self.scheduler.tasks:
            self.end_time = self.queue.now

    def run(self) -> SimOutcome:
        for spec in self.setup.tasks:
            self.queue.at(0.0, self.scheduler_event, Submit(spec))
        ranks = self.setup.world_ranks()
        for loss in self.setup.losses:
            self.queue.at(loss.at_s, self._lose, ranks[loss.role][loss.index], loss.role)
        self.queue.run(until_idle=lambda: self.end_time is not None)
        end = self.end_time if self.end_time is not None else self.queue.now
        return SimOutcome(end, self.events, self._hash.hexdigest() if self._hash else "",
                          self.busy_fractions(end),
                          {t: s.status for t, s in self.scheduler.tasks.items()})

    def busy_fractions(self, end: float) -> dict[str, float]:  # a lost rank counts as idle from its loss
        roles = {"rollout": self.rollout.values(), "env": self.env.values(), "trainer": self.trainers,
                 "scheduler": [self.control]}
        return {role: sum(min(w.meter.busy, end) for w in workers) / max(end, 1e-12) / len(workers)
                for role, workers in roles.items()}


def _describe(now: float, event, commands) -> str:
    """One trace line: time, the event and the commands it caused (task specs by id only)."""
    def short(item):
        if isinstance(item, Admit) and item.trainer_group:
            return f"Admit({item.spec.task_id}@{item.trainer_group})"
        if isinstance(item, (Submit, Admit)):
            return f"{type(item).__name__}({item.spec.task_id})"
        if isinstance(item, StepDone):
            return f"StepDone({item.task_id},{item.version})"
        return repr(item)

    return f"{now!r} {short(event)} -> {[short(c) for c in commands]}\n"
