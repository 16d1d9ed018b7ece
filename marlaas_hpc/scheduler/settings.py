"""The scheduler's settings a job chooses, declared once: `SchedulerSettings`.

    SchedulerSettings (mode, order, rollout_slots, max_adapters, trainer_slots)
        ├─ JobConfig   (config.py: the job's YAML, these keys at its top level)
        ├─ SimSetup    (sim/setup.py: a simulated job, `setup_from_job` copies them from the job config)
        └─ SchedulerConfig (core.py: the settings plus the ranks the scheduler drives, built by each of the above)
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from marlaas_hpc.config_loader import bounded, check_bounds
from marlaas_hpc.scheduler.modes import MODES

ORDERS = ("fair", "priority", "fifo")


@dataclass(kw_only=True)
class SchedulerSettings:
    mode: str = bounded("async", choices=MODES)
    """Scheduling: 'async' (MARLaaS), 'sync' (all tasks in lockstep rounds) or 'sequential' (one task at a time);
    one policy each (scheduler/modes.py)."""
    order: str = bounded("fair", choices=ORDERS)
    """Which ready task goes first: 'fair' (least recently served), 'priority' (TaskSpec.priority), 'fifo'."""
    rollout_slots: int = bounded(4, ge=1)
    """Prompt groups one rollout rank generates concurrently (its continuous batch, in groups). A slot counts a
    group's turn in the engine (Generated frees it, Resumed takes it again): a multi-turn group holds a slot for
    each turn while it is in the engine, none while its tool calls wait."""
    max_adapters: int = bounded(8, ge=1)
    """Adapter slots: tasks running at once (each rollout engine serves that many LoRAs); more wait queued."""
    trainer_slots: int = bounded(4, ge=1)
    """Train orders (of different tasks) in flight at once per trainer group; a group fuses those whose data is
    present into one step that shares the base model's forward and backward. 1 = one task per step."""

    def check_settings(self) -> None:
        """SpecError naming the first field out of its bounds (these settings, and those a subclass declares)."""
        check_bounds(self)

    def scheduler_settings(self) -> dict:
        """These settings by name (of a JobConfig or SimSetup: only the scheduler's), for a SchedulerConfig."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(SchedulerSettings)}
