"""The one driver of the scheduler under simulated time: an event queue and the real `Scheduler` on its clock.

    future events ─► EventQueue (time, then insertion order) ─► SimDriver.deliver(event)
                         ▲                                          │ Scheduler.handle
                         └──── the driver's ranks (`_execute`) ◄────┘ commands

`Simulation` (sim/engine.py) is the product's driver: ranks costed by a `Workload`. The scheduler's property
tests drive the same class with per-stage durations, reordered deliveries and injected losses
(tests/support/simloop.py `SimLoop`); the multi-model study puts several drivers on one queue
(tools/studies/multiplex.py). The scheduler reads the time from `queue.now`, so a driver whose queue is
replaced by a shared one follows that queue's clock.
"""
from __future__ import annotations

import heapq
import itertools

from marlaas_hpc.scheduler import Scheduler, SchedulerConfig


class EventQueue:
    """Simulated time: callbacks ordered by (time, insertion order), so ties are deterministic."""

    def __init__(self):
        self.now = 0.0
        self.handled = 0
        """Callbacks run so far (the simulation's own events, of which the scheduler's are a part)."""
        self._heap: list = []
        self._order = itertools.count()

    def at(self, time: float, callback, *args) -> None:
        heapq.heappush(self._heap, (time if time > self.now else self.now, next(self._order), callback, args))

    def after(self, delay: float, callback, *args) -> None:
        self.at(self.now + delay, callback, *args)

    def run(self, until_idle) -> None:
        heap, handled = self._heap, 0
        while heap and not until_idle():
            self.now, _, callback, args = heapq.heappop(heap)
            callback(*args)
            handled += 1
        self.handled += handled


class SimDriver:
    """The scheduler on a simulated clock. `deliver(event)` hands it one event and each command it answers to
    `_execute`, the subclass's ranks, which file future events on `queue`."""

    def __init__(self, config: SchedulerConfig | None = None, scheduler: Scheduler | None = None):
        """Either a config (the scheduler is built on this driver's clock) or a scheduler already built (its
        clock should read this driver's `queue.now`)."""
        self.queue = EventQueue()
        self.scheduler = scheduler if scheduler is not None else Scheduler(config, clock=lambda: self.queue.now)
        self.events = 0
        """Scheduler events delivered so far."""

    def deliver(self, event) -> list:
        """The scheduler handles `event`; its commands go to `_execute` in order. Returns them."""
        self.events += 1
        commands = self.scheduler.handle(event)
        self._handled(event, commands)
        for command in commands:
            self._execute(command)
        return commands

    def _handled(self, event, commands: list) -> None:
        """Seen between the scheduler's answer and its execution (a trace, a record); nothing by default."""

    def _execute(self, command) -> None:
        raise NotImplementedError
