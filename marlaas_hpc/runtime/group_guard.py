"""A trainer group agrees before it goes on (issue #36 item 3).

Every rank of a trainer group (TP x DP) runs the same ops in the same order, and the collectives of those ops pair
up by order. An error on one rank only in the middle of a step (CUDA out of memory is per rank: the leader alone
holds up to 16 posted delta buffers) used to end the step on that rank alone: its peers were left blocked in a
collective it would never issue, or paired the next op's collectives with the wrong ones (on NCCL a hang, or
silently wrong sums), and the tasks of the step were failed for an error no task caused.

`GroupGuard.run` wraps each stretch of an op that issues TP/DP collectives (a section: a fused training step, the
publication of its versions, an admission) on every rank of the group:

    section ── returned ─────────────────────────────────┐
       │ raised                                           ▼
       ▼                                          vote: every rank's [kind, error signature] over a gloo
    alarm (the group's store), this rank's        control group of its own (the group's store, never taken
    groups taken down: a peer waiting in one      down); all returned: go on
    fails at once (gloo: its socket closed;               │ some raised
    NCCL: its watcher sees the alarm and                  ▼
    aborts its own communicators)  ───────────▶   every rank: groups taken down and made again in place
                                                  (trainer/process_groups.py), the section's tasks restored
                                                  from the host snapshot taken before it, then:
        - the same error on every rank (kind TASK, one signature): the task's fault; TaskFault, and the op's tasks
          fail as before (a staleness violation, a shard saved at another TP size, ...);
        - a storage error, or only collectives that failed with no rank at the origin (a peer process gone, a
          channel outside the group): the job's fault, raised as before (the rank ends; the job resumes);
        - otherwise (out of memory, an error of some ranks only): the section again, at most MAX_ATTEMPTS times;
          after that an error still of some ranks only fails the op's tasks (TaskFault), and out of memory ends
          the group (GroupGaveUp on the rank at fault, GroupFault on the others): rank 0 rolls its tasks back to
          their checkpoints, none fails.

Why the failing rank must take its groups down before the vote: its peers may be inside a collective it will not
join, and only it can get them out (gloo's `abort()` ends nothing pending; closing its sockets does). Why every rank
makes its groups again afterwards: which collectives completed where is unknown, and NCCL pairs by order.
"""
from __future__ import annotations

import threading
import time
import zlib
from dataclasses import dataclass

import torch

from marlaas_hpc.runtime.faults import (GroupFault, GroupGaveUp, describe, is_out_of_memory, is_peer_lost,
                                        is_storage_error)

OK, TASK, RANK, PEER, JOB = range(5)
"""A rank's outcome of a section: returned; raised an error of no other kind (the task's, if every rank raised it
alike); ran out of memory; a collective failed under it (a peer's take-down, an abort, a peer gone); a storage
error (the job's)."""
KINDS = ("ok", "task", "rank", "peer", "job")


class TaskFault(RuntimeError):
    """Every rank raised the same error in a section (or some ranks did, on every attempt): the op's tasks fail.
    The section's tasks are back where they were before it (a fused step can be tried again task by task)."""

    def __init__(self, stage: str, reason: str):
        super().__init__(reason)
        self.stage, self.reason = stage, reason


@dataclass
class Failure:
    kind: int
    text: str
    """'Type: message', as a task failure reports it."""
    error: BaseException | None = None
    """The error itself, its tracebacks dropped: their frames hold the failed step's activations (and, on gloo,
    references to the groups that must close)."""

    @classmethod
    def of(cls, exc: BaseException) -> "Failure":
        if is_out_of_memory(exc):
            kind = RANK
        elif is_storage_error(exc):
            kind = JOB
        elif is_peer_lost(exc):
            kind = PEER
        else:
            kind = TASK
        chain, seen = [exc], set()
        while chain:  # the error and every error it was raised from or while handling
            link = chain.pop()
            if link is not None and id(link) not in seen:
                seen.add(id(link))
                link.__traceback__ = None
                chain += [link.__cause__, link.__context__]
        return cls(kind, describe(exc), exc)

    @property
    def signature(self) -> int:
        return zlib.crc32(self.text.encode())


class _Watcher:
    """NCCL: aborts this rank's groups as soon as a peer's alarm is in the store, so that a collective (or a host
    sync behind one) waiting for that peer ends. Armed for one section at a time."""

    POLL_S = 0.02

    def __init__(self, store, abort):
        self.store, self.abort = store.clone(), abort  # a client of its own: the main thread uses the store too
        self.lock = threading.Lock()
        self.armed = threading.Event()
        self.key: str | None = None
        self.fired = False
        threading.Thread(target=self._loop, name="group-guard-watcher", daemon=True).start()

    def arm(self, key: str) -> None:
        with self.lock:
            self.key, self.fired = key, False
        self.armed.set()

    def disarm(self) -> bool:
        """Whether it fired; once this returns it aborts nothing more (a remade group is never aborted)."""
        with self.lock:
            self.key = None
            self.armed.clear()
            return self.fired

    def _loop(self) -> None:
        while True:
            self.armed.wait()
            with self.lock:
                if self.key is not None and not self.fired and self._alarmed(self.key):
                    self.fired = True
                    self.abort()
            time.sleep(self.POLL_S)

    def _alarmed(self, key: str) -> bool:
        try:
            return self.store.check([key])
        except Exception:  # the store's host (the leader) is gone: the vote says so
            return False


class GroupGuard:
    """Runs sections of ops on every rank of one trainer group and makes them end together (module doc)."""

    MAX_ATTEMPTS = 3

    def __init__(self, trainer, clock=None, before_retry=None, watch: bool | None = None):
        """`trainer`: the rank's MultiLoraTrainer (its groups, store and task states); `clock`: a BusyClock that
        notes each failed section ('regroup'); `before_retry(failure)`: called with this rank's own Failure (or None)
        before a section runs again."""
        self.trainer, self.clock, self.before_retry = trainer, clock, before_retry
        self.rank, self.size, self.store = trainer.group_rank, trainer.group_size, trainer.group_store
        self.watch = trainer.backend == "nccl" if watch is None else watch
        """Whether peers watch the store for an alarm and abort their own groups (NCCL: a pending collective ends
        only so). On gloo the failing rank's take-down frees them."""
        self.seq = 0
        """Sections run, the same count on every rank of the group (the alarm's key)."""
        self.watcher = None
        self.taken_down = False
        self.left: list[str] = []
        """Groups the last take-down could not free (something still held them): reported, never expected."""
        self.regroups: list[dict] = []
        """Each failed section: its name, tasks, attempt, the failed ranks and why, what followed."""

    def run(self, stage: str, body, tasks=()):
        """body() on this rank, as every rank of the group runs it (collective). Returns its result once every
        rank's returned; restores `tasks` (trainer state) and raises, or runs it again, as the module doc says."""
        saved = None

        def section():
            nonlocal saved
            if saved is None:  # inside the attempt: a snapshot that runs out of memory is one rank's failure too
                saved = self.trainer.snapshot(tasks)
            return body()

        for attempt in range(1, self.MAX_ATTEMPTS + 1):
            started = time.time()
            result, mine = self._attempt(section)
            votes = self._vote(mine)
            if all(kind == OK for kind, _ in votes):
                return result
            result = None
            self._settle(stage, list(tasks), attempt, started, mine, votes, saved)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            if self.before_retry is not None:
                self.before_retry(mine)
        raise AssertionError("unreachable: the last attempt settles by raising")

    # ---- one attempt ----
    def _attempt(self, body):
        self.seq += 1
        self.taken_down, self.left = False, []
        if self.watch and self.size > 1:
            self._watcher().arm(self._alarm_key())
        try:
            result, mine = body(), None
        except Exception as exc:  # whatever it is, the group decides together what it means
            result, mine = None, Failure.of(exc)
        if self.watcher is not None and self.watcher.disarm():  # a peer's alarm aborted this rank's groups
            if mine is None:  # what it computed after that is not sound
                mine = Failure(PEER, "its groups were aborted: a peer's section failed")
            elif mine.kind == TASK:  # what an aborted communicator raises is the abort's doing
                mine.kind = PEER
        if mine is not None and self.size > 1:
            self._alarm(mine)
            self._take_down()
        return result, mine

    def _alarm_key(self) -> str:
        return f"guard/alarm/{self.seq}"

    def _alarm(self, mine: Failure) -> None:
        try:
            self.store.set(f"guard/why/{self.rank}", mine.text)
            self.store.set(self._alarm_key(), str(self.rank))
        except Exception:  # the store's host is gone: the vote fails on its own
            pass

    def _take_down(self) -> None:
        if not self.taken_down:
            self.taken_down = True
            self.left = self.trainer.take_down_groups()

    def _vote(self, mine: Failure | None) -> list[tuple[int, int]]:
        own = (OK, 0) if mine is None else (mine.kind, mine.signature)
        if self.size == 1:
            return [own]
        everyone = [torch.zeros(2, dtype=torch.int64) for _ in range(self.size)]
        # the trainer's control group: gloo over the group's store, never taken down (a peer gone fails it)
        self.trainer.control_group.allgather([everyone], [torch.tensor(own, dtype=torch.int64)]).wait()
        return [(int(vote[0]), int(vote[1])) for vote in everyone]

    def _watcher(self) -> _Watcher:
        if self.watcher is None:
            from marlaas_hpc.trainer.process_groups import abort_all

            self.watcher = _Watcher(self.store, abort_all)
        return self.watcher

    # ---- after a failed vote (the same decision on every rank) ----
    def _settle(self, stage, tasks, attempt, started, mine, votes, saved) -> None:
        kinds = [kind for kind, _ in votes]
        failed = [rank for rank, kind in enumerate(kinds) if kind != OK]
        why = self._reasons(failed, mine)
        record = {"section": stage, "attempt": attempt, "failed": {str(r): why[r] for r in failed},
                  "kinds": {str(r): KINDS[kinds[r]] for r in failed}}
        if JOB in kinds or all(kinds[rank] == PEER for rank in failed):
            self._note(tasks, started, record, "job fault")
            if mine is not None and mine.kind in (JOB, PEER) and mine.error is not None:
                raise mine.error  # what it was: a storage error or a lost peer ends the rank, as before
            raise GroupFault(f"trainer group: rank {failed[0]} failed in {stage}: {why[failed[0]]}")
        self._recover(saved)
        if all(kind == TASK for kind in kinds) and len({signature for _, signature in votes}) == 1:
            self._note(tasks, started, record, "task fault")
            raise TaskFault(stage, why[0])
        if attempt < self.MAX_ATTEMPTS:
            self._note(tasks, started, record, "again")
            return
        if TASK in kinds:  # an error of some ranks only, on every attempt: the tasks' (as before this guard)
            self._note(tasks, started, record, "task fault")
            raise TaskFault(stage, why[kinds.index(TASK)])
        self._note(tasks, started, record, "gave up")
        if mine is not None and mine.kind == RANK:
            raise GroupGaveUp(f"trainer group rank {self.rank}: {mine.text}, in {stage} on each of "
                              f"{self.MAX_ATTEMPTS} attempts")
        raise GroupFault(f"trainer group: rank {failed[0]} failed in {stage} on each of {self.MAX_ATTEMPTS} "
                         f"attempts: {why[failed[0]]}")

    def _reasons(self, failed: list[int], mine: Failure | None) -> dict[int, str]:
        why = {}
        for rank in failed:
            if rank == self.rank and mine is not None:
                why[rank] = mine.text
                continue
            try:
                why[rank] = self.store.get(f"guard/why/{rank}").decode()
            except Exception:
                why[rank] = "(unknown)"
        return why

    def _recover(self, saved) -> None:
        """Every rank's groups made again and the section's tasks put back."""
        try:
            if self.size > 1:
                self._take_down()
                self.trainer.remake_groups()
            if saved is not None:  # (None: this rank failed in the snapshot, before anything changed)
                self.trainer.restore(saved)
        except Exception as exc:
            raise GroupGaveUp(f"trainer group rank {self.rank}: its groups could not be made again: "
                              f"{describe(exc)}") from exc

    def _note(self, tasks, started, record: dict, outcome: str) -> None:
        record = {**record, "outcome": outcome, "left_open": self.left}
        self.regroups.append({"tasks": tasks, **record})
        if self.clock is not None:
            self.clock.note("regroup", tuple(tasks), started, time.time(), **record)
