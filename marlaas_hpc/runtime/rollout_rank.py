"""Rollout rank: serves every task's generation requests from one engine (continuous batch), receives LoRA
deltas from the trainer group leaders (runtime/delta/fanin.py) or, under `delta.transport: relay`, from its own
relay (runtime/delta/relay_plane.py: it then pins each open group's version there until the group completes), and sends
finished turns straight to their env rank.

A prompt group's first turn comes from rank 0 (GenerateWork). Training work asked for a superseded version
samples with the newest one. When a group's turn is done (its G completions): GroupTurn to the env rank, Generated
to rank 0, which frees the group's rollout slot. Single-turn groups are then done. Multi-turn groups (tool tasks)
stay open: the env rank answers each turn with ContinueGroup (the next turn of the episodes that go on, sampled
with the group's version, never a newer one) until it sends GroupEnded. A slot counts a group's turn in the
engine, not its life: while its tool calls wait on a service the group holds none, and its next turn takes one
again when it enters the batch (Resumed to rank 0). A slot held through the tool waits kept the other tasks'
groups out of an idle engine: single-turn tasks next to a lookup task stepped at the pace of its tool. The
group's version is pinned in the engine from its first turn to GroupEnded, so the engine cannot retire it while
an episode waits on a tool.

Each version's delta goes into the engine as tensors (`AdapterRef(..., tensors=..., lora=...)`): no directory
per version on a rollout rank. The engine holds them in host memory until it retires the version (superseded,
no request on it, no episode pinning it); rollout/vllm_engine.py says why memory and not a pinned LoRA cache.

An engine that fails (rollout/restart.py: RestartingEngine) is rebuilt in place and its requests re-issued; the
rank tells rank 0 (EngineRestarted), which logs it. Its groups go on as if nothing happened.

A rank of a job with several base models drives a `ModelEngines` (rollout/model_engines.py: one engine per model,
one awake) through the same calls: each task's model comes with its work (GenerateWork.model) and its versions
(DeltaAnnounce.model), and each switch of the awake engine is a `switch` note in the rank's timeline (which model
it left and woke, and what it cost); summary.json's rollout extras count them. Rank 0 decides which model the
rank serves (scheduler/rank_models.py): its `Serve` makes the ModelEngines follow that model (`follow`), and
once that model's engine is awake the rank answers `Served` with the switch's measured cost.
"""
from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from pathlib import Path

from marlaas_hpc.rollout import AdapterRef, Generation, GenerationRequest
from marlaas_hpc.rollout.model_engines import ModelEngines
from marlaas_hpc.runtime.comm import BusyClock, Outbox, drain, write_timeline
from marlaas_hpc.runtime.messages import (TAG_CMD, TAG_DATA, TAG_EVENT, ContinueGroup, EngineRestarted, FeedWeights,
                                          GenerateWork, Generated, GroupEnded, GroupTurn, PromptGroup, RankStats,
                                          RanksChanged, RepackGroup, Resumed, Serve, Served, Shutdown)


def turn_seed(job_seed: int, group_id: str, turn: int) -> int:
    """The sampling seed of a group's turn, from the job's seed and the turn's identity only; episode j samples
    with seed + j (consecutive seeds: VllmEngine sends the G requests as one vLLM request of G samples). A counter
    of submissions gave a group other tokens when an eval (or another task's group) happened to reach the rank
    before it, so two runs of one job diverged at a timing-dependent moment."""
    digest = hashlib.blake2b(f"{job_seed}:{group_id}@{turn}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % (2**31 - 2**20)  # room for seed + j (G < 2**20)


@dataclass(frozen=True)
class _RequestOf:
    """What an engine request samples: one episode's turn of a prompt group."""

    group_id: str
    episode: int
    turn: int


@dataclass
class _SamplingGroup:
    work: GenerateWork
    group: PromptGroup
    version: int | None
    """The group's version for every turn (pinned in the engine while the group is open, multi-turn)."""
    t0: float
    turn: int = 1
    waiting: set[int] = field(default_factory=set)
    """Episodes whose current turn is still generating."""
    done: dict[int, Generation] = field(default_factory=dict)
    newest: int | None = None
    model_tokens: dict[int, int] = field(default_factory=dict)
    """Episode -> tokens sampled over all its turns."""
    sampled_until: float | None = None
    """When its latest turn finished generating (a multi-turn group stays open after its last turn until the env
    rank's GroupEnded arrives, but samples nothing more)."""
    relay_pin: bool = False
    """Relay mode: its version is pinned at this rank's relay (released when the group completes)."""
    repacked_from: int | None = None
    """A tail rank: the rollout rank that handed the group over (runtime/repack.py); it sent the group's Generated."""


class RolloutRank:
    def __init__(self, comm, engine, delta_channel, seed: int = 0, run_dir: Path | None = None,
                 model_dir: Path | None = None, repacker=None, tail=None):
        self.comm, self.engine, self.delta = comm, engine, delta_channel
        self.repacker = repacker
        """Repack on, a regular rank (runtime/repack.py Repacker): hands long tails over to tail ranks."""
        self.tail = tail
        """Repack on, a tail rank (runtime/repack.py TailVersions): keeps the versions handed groups need."""
        self.pins = delta_channel if delta_channel.pins_versions else None
        """Relay mode (runtime/delta/relay_plane.py RelayFeed): the relay that keeps each open group's version."""
        self.run_dir = run_dir
        self.model_dir = model_dir
        """The base model's files its engine started from: what it sends a joining rank (FeedWeights)."""
        self.feeds: list = []
        """Joiners it is sending the base weights to (runtime/peer_weights.py PeerFeed), a few chunks per turn."""
        self.rank = comm.Get_rank()
        self.seed = seed
        self.versions: dict[str, int] = {}
        self.waiting: list[GenerateWork] = []
        self.open_groups: dict[str, _SamplingGroup] = {}
        self.requests: dict[str, _RequestOf] = {}
        """Engine request id -> the group, episode and turn it samples (until it finishes)."""
        self.clock = BusyClock()
        self.delta.clock = self.clock  # the transport's own work (a relay tier re-formed) on this rank's timeline
        self.outbox = Outbox(comm)
        self.models = engine if isinstance(engine, ModelEngines) else None
        """A job of several base models: the engine per model (None: one engine)."""
        self.serve: tuple[str, float, float] | None = None
        """Rank 0's last Serve not answered yet: (model, sleep s, wake s of the switch to it so far)."""
        if hasattr(engine, "on_restart"):  # a RestartingEngine
            engine.on_restart = self._engine_restarted

    def _engine_restarted(self, cause: str, restarts: int, requests: int) -> None:
        self.outbox.send(EngineRestarted(self.rank, cause, restarts, requests), 0, TAG_EVENT)

    def run(self) -> None:
        while True:
            self.outbox.progress()
            self._drain_deltas()
            # every command waiting: taking one per loop turn (one engine step, 10-30 ms) left work for freed
            # slots queued in MPI while the engine ran half-empty batches (rank 0 issues a group per freed slot)
            commands = drain(self.comm, TAG_CMD, source=0)
            shutdown = next((command for command in commands if isinstance(command, Shutdown)), None)
            if shutdown is not None:
                self._finish_feeds()
                self.comm.members.ended_lost = shutdown.lost
                self.comm.members.drained = shutdown.reason == "drained"
                break
            for command in commands:  # in rank 0's order: a RanksChanged comes before what depends on it
                if isinstance(command, GenerateWork):
                    self.waiting.append(command)
                elif isinstance(command, RanksChanged):
                    self._ranks_changed(command)
                elif isinstance(command, FeedWeights):
                    self._feed(command)
                elif isinstance(command, Serve):
                    self.models.follow(command.model)
                    self.serve = (command.model, 0.0, 0.0)
            self._progress_feeds()
            self._submit_ready()
            from_env = self._drain_env()
            if self.engine.has_unfinished():
                tasks = self._generating_tasks()
                with self.clock.track("generate", tasks):  # the span takes `tasks` as they are at its end
                    finished = self.engine.step()
                    if self.models is not None:  # the step may have switched models: the awake one's tasks
                        tasks[:] = self._generating_tasks(self.models.awake)
                self._note_switches()
                self._collect(finished)
                if self.repacker is not None:
                    self._maybe_hand_over()
            elif not commands and not from_env and not self.feeds:
                time.sleep(0.002)
            if self.serve is not None:
                self._answer_serve()
            self._drop_retired()
        extra = {"engine_restarts": getattr(self.engine, "restarts", 0), "occupancy": self.engine.occupancy()}
        if self.models is not None:
            switches = self.models.switches
            extra.update(models=self.models.models, model_switches=len(switches),
                         model_switch_s=sum(cost.total_s for cost in switches))
        self.outbox.send(RankStats(self.rank, "rollout", self.clock.busy, self.clock.wall(), extra), 0, TAG_EVENT)
        if self.run_dir is not None:
            write_timeline(self.run_dir, self.rank, "rollout", self.clock)
        self.outbox.flush()
        self.delta.close()  # relay mode: this rank's relay ends once every leader has closed
        # the engine is not shut down: the process ends next (runtime/main.py end_rank), and vLLM's orderly
        # shutdown took ~0.9 s that frees nothing the exit does not

    def _generating_tasks(self, model: str | None = None) -> list[str]:
        """The tasks of the open groups (of `model` only, when given: the awake engine's)."""
        return sorted({entry.work.task_id for entry in self.open_groups.values()
                       if model is None or entry.work.model == model})

    def _note_switches(self) -> None:
        """Each switch of the awake model's engine in the last step: a timeline note (it ended now)."""
        if self.models is None:
            return
        now = time.time()
        for cost in self.models.pop_switches():
            self.clock.note("switch", (), now - cost.total_s, now, from_model=cost.from_model,
                            to_model=cost.to_model, sleep_s=cost.sleep_s, wake_s=cost.wake_s)
            if self.serve is not None and cost.to_model == self.serve[0]:
                self.serve = (cost.to_model, cost.sleep_s, cost.wake_s)

    def _answer_serve(self) -> None:
        """Rank 0's Serve is done once its model's engine is awake: Served, with what the switch cost."""
        if self.serve is None or self.models.awake != self.serve[0]:
            return
        model, sleep_s, wake_s = self.serve
        self.serve = None
        self.outbox.send(Served(self.rank, model, sleep_s, wake_s), 0, TAG_EVENT)

    # ---- base weights for a joining rank (runtime/peer_weights.py) ----
    def _feed(self, command: FeedWeights) -> None:
        from marlaas_hpc.runtime.membership import connect_link
        from marlaas_hpc.runtime.peer_weights import PeerFeed

        with self.clock.track("feed_weights", ()):
            self.feeds.append((command.rank, PeerFeed(connect_link(command.port, self.rank), self.model_dir)))

    def _progress_feeds(self) -> None:
        """A few more chunks to each joiner (at most the sender's window per turn); a finished feed's link ends."""
        for entry in list(self.feeds):
            rank, feed = entry
            if feed.progress():
                self.feeds.remove(entry)
                feed.close()
                if feed.sender.failed is not None:
                    print(f"[join] rollout rank {self.rank}: joiner {rank} lost while it was sent the base weights",
                          flush=True)

    def _finish_feeds(self) -> None:
        while self.feeds:
            self._progress_feeds()
            time.sleep(0.001)

    def _ranks_changed(self, change: RanksChanged) -> None:
        """An env rank lost: the groups bound for it were issued again elsewhere; each is closed here (its version
        unpinned) and its slot freed at rank 0 (Generated). A trainer leader lost: its delta channel is left
        behind (its tasks come back under new adapter names: GenerateWork.adapter). A changed set of rollout ranks
        needs nothing here: each leader sends the address of its remade delta channel (runtime/delta/fanin.py), or the
        first leader that of the re-formed relay tier (runtime/delta/relay_plane.py), taken by the next `delta.poll`."""
        members = self.comm.members
        self.comm.apply(change)
        for rank in change.lost:
            if members.kind_of.get(rank) == "env":
                self._env_lost(rank)
            elif rank in self.delta.leaders:  # a lost trainer group's leader
                self.delta.drop_leader(rank)

    def _env_lost(self, rank: int) -> None:
        for group_id in [gid for gid, entry in self.open_groups.items() if entry.work.env_rank == rank]:
            self._end(group_id)
        for work in [work for work in self.waiting if work.env_rank == rank]:
            self.waiting.remove(work)
            if not work.eval:
                self.outbox.send(Generated(self.rank, tuple(g.group_id for g in work.groups)), 0, TAG_EVENT)

    def _drain_deltas(self) -> None:
        """Joins the announced broadcasts (a leader blocks until all rollout ranks join; with several trainer
        groups, `DeltaFanIn` keeps each leader's order), or takes each task's newest version from this rank's relay
        (`RelayFeed`), and installs each version newer than the one held: a
        task that moved between groups may see its old group's last version land after its new group's next."""
        for announce, receive in self.delta.poll():
            with self.clock.track("load_delta", (announce.task_id,), version=announce.version):
                tensors = receive()
                if announce.version <= self.versions.get(announce.task_id, -1):
                    continue
                if self.models is not None:
                    self.models.assign(announce.task_id, announce.model)
                self.engine.add_adapter(AdapterRef(announce.task_id, announce.version, tensors=tensors,
                                                   lora=announce.lora))
                if self.tail is not None:
                    self.tail.installed(self.engine, announce.task_id, announce.version)
            self.versions[announce.task_id] = announce.version

    def _drop_retired(self) -> None:
        """Notes the versions the engine retired (superseded, no request on them, no episode pinning them) and
        so freed: until then it keeps their tensors (a request naming them, an LRU reload in vLLM)."""
        now = time.time()
        for ref in self.engine.pop_retired():
            self.clock.note("drop_adapter", (ref.task_id,), now, now, version=ref.version)

    def _submit_ready(self) -> None:
        """Starts work whose adapter version is here (a Generate may overtake its version's delta). Training
        work asked for a version that is already superseded samples with the newest one instead (older
        versions are retired once unused, and a newer policy is never staler); eval work keeps its version."""
        still_waiting = []
        for work in self.waiting:
            have = self.versions.get(work.adapter_key, -1)
            if work.version is not None and have < work.version:
                still_waiting.append(work)
                continue
            if work.version is not None and not work.eval:
                work.version = have
            self._start(work)
        self.waiting = still_waiting

    def _start(self, work: GenerateWork) -> None:
        if self.models is not None:
            self.models.assign(work.adapter_key, work.model)
        requests = []
        for group in work.groups:
            entry = _SamplingGroup(work, group, work.version, time.time())
            self.open_groups[group.group_id] = entry
            if self.pins is not None and work.version is not None:
                entry.relay_pin = self.pins.pin(work.adapter_key, work.version)
            if work.multi_turn and work.version is not None:
                self.engine.pin(work.adapter_key, work.version)
            contexts = [group.prompt_ids] * work.group_size
            requests += self._turn_requests(entry, list(range(work.group_size)), contexts)
        self.engine.submit(requests)

    def _turn_requests(self, entry: _SamplingGroup, episodes: list[int], contexts: list[list[int]]):
        work = entry.work
        entry.waiting, entry.done = set(episodes), {}
        entry.newest = self.versions.get(work.adapter_key)
        requests = []
        seed = turn_seed(self.seed, entry.group.group_id, entry.turn)
        for j, context in zip(episodes, contexts):
            request_id = f"{entry.group.group_id}#{j}@{entry.turn}"  # unique and readable; never parsed back
            self.requests[request_id] = _RequestOf(entry.group.group_id, j, entry.turn)
            requests.append(GenerationRequest(
                request_id=request_id, task_id=work.adapter_key,
                adapter_version=entry.version, prompt_ids=context, temperature=work.temperature,
                max_new_tokens=self._turn_cap(work, len(context)) if entry.group.completion_tokens is None
                else entry.group.completion_tokens[j],
                ignore_stop=entry.group.completion_tokens is not None,
                seed=seed + j, return_routes=work.routes))
        return requests

    @staticmethod
    def _turn_cap(work: GenerateWork, context_len: int) -> int:
        """The turn's token cap, cut to the episode's token budget (at least one token: the env ends an
        episode before its budget runs out, and a prompt over budget still gets its one turn)."""
        if work.episode_tokens is None:
            return work.max_new_tokens
        return max(1, min(work.max_new_tokens, work.episode_tokens - context_len))

    # ---- messages from env ranks (multi-turn) ----
    def _drain_env(self) -> bool:
        messages = drain(self.comm, TAG_DATA)
        for message in messages:
            if isinstance(message, ContinueGroup):
                self._continue(message)
            elif isinstance(message, GroupEnded):
                self._end(message.group_id)
            elif isinstance(message, RepackGroup):
                self._take_repacked(message)
        return bool(messages)

    def _continue(self, message: ContinueGroup) -> None:
        entry = self.open_groups.get(message.group_id)
        if entry is None:  # ended meanwhile (its task failed)
            return
        entry.turn = message.turn
        self.engine.submit(self._turn_requests(entry, message.episodes, message.contexts))
        if not entry.work.eval:
            self.outbox.send(Resumed(self.rank, (message.group_id,)), 0, TAG_EVENT)

    def _end(self, group_id: str) -> None:
        """Closes a multi-turn group; a turn still generating (its task failed) is dropped when it finishes, and
        its slot is freed now."""
        entry = self.open_groups.pop(group_id, None)
        if entry is None:
            return
        if entry.waiting and not entry.work.eval:
            self.outbox.send(Generated(self.rank, (group_id,), (entry.version,)), 0, TAG_EVENT)
        if entry.version is not None:
            self.engine.unpin(entry.work.adapter_key, entry.version)
        self._note_group(entry)

    # ---- finished turns ----
    def _collect(self, finished) -> None:
        complete = []
        for gen in finished:
            request = self.requests.pop(gen.request_id)
            entry = self.open_groups.get(request.group_id)
            if entry is None or request.turn != entry.turn:
                continue  # its group ended while this turn was generating
            entry.done[request.episode] = gen
            entry.waiting.discard(request.episode)
            entry.model_tokens[request.episode] = entry.model_tokens.get(request.episode, 0) + len(gen.completion_ids)
            if self.repacker is not None and not entry.work.multi_turn and not entry.work.eval:
                self.repacker.record(entry.work.task_id, len(gen.completion_ids))
            if not entry.waiting:
                complete.append(entry)
        for entry in complete:
            self._send_turn(entry)

    def _send_turn(self, entry: _SamplingGroup) -> None:
        work, group = entry.work, entry.group
        entry.sampled_until = time.time()
        episodes = sorted(entry.done)
        gens = [entry.done[j] for j in episodes]
        data = GroupTurn(work.task_id, group.group_id, group.prompt_index, entry.version, group.prompt_ids,
                         [g.completion_ids for g in gens], [g.logprobs for g in gens], eval=work.eval,
                         turn=entry.turn, episodes=episodes, sampled_versions=[g.adapter_version for g in gens],
                         newest_version=entry.newest, routes=[g.routes for g in gens] if work.routes else None)
        self.outbox.send(data, work.env_rank, TAG_DATA)
        if not work.eval and entry.repacked_from is None:  # the turn left the engine: its slot is free
            self.outbox.send(Generated(self.rank, (group.group_id,), (entry.version,)), 0, TAG_EVENT)
        if work.multi_turn:
            return
        del self.open_groups[group.group_id]
        self._note_group(entry)

    # ---- repack (runtime/repack.py) ----
    def _maybe_hand_over(self) -> None:
        """After a step: held by a tail (Repacker.held_by_tail), every group with a request running goes to a
        tail rank. Only when nothing waits, and only single-turn training groups."""
        if self.waiting or not self.engine.has_unfinished():
            return
        running = {}
        for request_id, tokens in self.engine.progress().items():
            entry = self.open_groups.get(self.requests[request_id].group_id)
            if entry is None or entry.work.multi_turn or entry.work.eval or entry.version is None:
                return
            running[request_id] = (entry.work.task_id, tokens)
        if self.repacker.held_by_tail(running):
            for group_id in sorted({self.requests[request_id].group_id for request_id in running}):
                self._hand_over(group_id)

    def _hand_over(self, group_id: str) -> None:
        """Cuts the group's running requests (engine.abort: their continuations) and sends it to a tail rank;
        rank 0 hears its turn left this engine (Generated), so the slot takes new work."""
        entry = self.open_groups.pop(group_id)
        request_ids = [request_id for request_id, of in self.requests.items() if of.group_id == group_id]
        continuations = {self.requests.pop(req.request_id).episode: req for req in self.engine.abort(request_ids)}
        for request_id in request_ids:  # finished meanwhile: not in flight any more
            self.requests.pop(request_id, None)
        tail = self.repacker.next_tail()
        work = entry.work
        single = GenerateWork(work.task_id, work.version, work.env_rank, [entry.group], work.group_size,
                              work.temperature, work.max_new_tokens, adapter=work.adapter, model=work.model,
                              routes=work.routes)
        self.outbox.send(RepackGroup(self.rank, single, entry.group, entry.version, dict(entry.done), continuations,
                                     entry.newest, entry.t0), tail, TAG_DATA)
        self.outbox.send(Generated(self.rank, (group_id,), (entry.version,)), 0, TAG_EVENT)
        now = time.time()
        self.clock.note("repack_out", (work.task_id,), now, now, group_id=group_id, to_rank=tail,
                        version=entry.version, cut_tokens=[len(c.partial_ids) for c in continuations.values()])

    def _take_repacked(self, message: RepackGroup) -> None:
        """A group handed over by `message.source`: its continuations go into this engine under their version;
        if this rank no longer holds it, the group is past its bound for good and goes on as cut (dropped at
        rank 0)."""
        group_id = message.group.group_id
        entry = _SamplingGroup(message.work, message.group, message.version, message.t0,
                               done=dict(message.done), newest=message.newest, repacked_from=message.source,
                               waiting=set(message.continuations))
        for j, gen in entry.done.items():
            entry.model_tokens[j] = len(gen.completion_ids)
        self.open_groups[group_id] = entry
        key = message.work.adapter_key
        held = self.tail.holds(self.engine, key, message.version)
        now = time.time()
        self.clock.note("repack_in", (message.work.task_id,), now, now, group_id=group_id, from_rank=message.source,
                        version=message.version, held=held)
        if not held:
            for j, req in message.continuations.items():
                entry.done[j] = Generation(req.request_id, req.task_id, req.adapter_version, list(req.prompt_ids),
                                           list(req.partial_ids), list(req.partial_logprobs), "length",
                                           meta={"repack": "version gone"})
            entry.waiting.clear()
            self._send_turn(entry)
            return
        for j, req in message.continuations.items():
            self.requests[req.request_id] = _RequestOf(group_id, j, entry.turn)
        self.engine.submit(list(message.continuations.values()))

    def _note_group(self, entry: _SamplingGroup) -> None:
        """The group's timeline record; it completed, so its relay pin (relay mode) is released here, after
        noting whether the relay still held its version and whether a newer one had come meanwhile."""
        relay = {}
        if entry.relay_pin:
            key = entry.work.adapter_key
            relay = {"relay_held": self.pins.holds(key, entry.version),
                     "superseded": self.versions.get(key, -1) > entry.version}
            self.pins.unpin(key, entry.version)
            entry.relay_pin = False
        self.clock.note("group", (entry.work.task_id,), entry.t0, time.time(), group_id=entry.group.group_id,
                        eval=entry.work.eval, prompt_tokens=len(entry.group.prompt_ids), turns=entry.turn,
                        completion_tokens=[entry.model_tokens.get(j, 0) for j in range(entry.work.group_size)],
                        version=entry.version, sampled_until=entry.sampled_until, **relay)
