"""Rank 0 at scale (issue 30): what it writes into the run dir per event does not grow with the number of tasks.

Rank 0's run-dir books (RunBooks: the records a resume starts from, audit.jsonl, status.json) are driven by the
simulator's stream of scheduler events, the one the runtime's rank 0 handles, with a trainer that saves every
task at every step. The bytes are the kernel's count of what the process wrote (/proc/self/io wchar), not a
time: the same events give the same count on any machine, under any load.

status.json is the one write driven by time, not by events: at most once per StatusBoard.PERIOD_S, every task's
entry in it (O(tasks) bytes a second, none of them encoded again unless the task changed). Its bytes per event
depend on the event rate, so it is checked on its own: written at most once a period, encoding only what
changed."""
import dataclasses
import json
import sys
from pathlib import Path

import pytest

from marlaas_hpc.config import JobConfig
from marlaas_hpc.runtime.checkpoint import load_job_checkpoint
from marlaas_hpc.runtime.outputs import RunBooks, StatusBoard
from marlaas_hpc.scheduler import StepDone
from marlaas_hpc.sim.workload import load_workload

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))


def _bytes_written() -> int:
    with open("/proc/self/io") as source:
        return next(int(line.split()[1]) for line in source if line.startswith("wchar:"))


def _books_run(n_tasks: int, run_dir: Path):
    """A simulated job of n_tasks whose scheduler events also go through RunBooks, as rank 0's loop does:
    (bytes written per event by `handled`, events, the simulation, the books). status.json's writes (`tick`)
    are counted apart: (bytes, writes) in books.status_writes."""
    from bench_sim import simulation

    workload = load_workload(ROOT / "configs/workloads/tiny-cpu.yaml")
    sim = simulation(n_tasks, "async", 3, dataclasses.replace(workload, evals=False))
    job = JobConfig.load(ROOT / "configs" / "calib-small.yaml")
    books = RunBooks(run_dir, job, sim.scheduler, None, start=0.0, clock=lambda: sim.queue.now)
    books.records.open_run(0.0, 0.0)
    handle, events, status = sim.scheduler.handle, [0], [0, 0]

    def handled(event):
        if isinstance(event, StepDone) and event.version > 0:
            books.task_saved(event.task_id, event.version)  # checkpoint.every_steps 1: the trainer's TaskSaved
        commands = handle(event)
        books.handled(event, commands)
        events[0] += 1
        if books.status.due():
            before = _bytes_written()
            books.tick()
            status[0] += _bytes_written() - before
            status[1] += 1
        return commands

    sim.scheduler.handle = handled
    before = _bytes_written()
    sim.run()
    per_event = (_bytes_written() - before - status[0]) / events[0]
    books.status_writes = tuple(status)
    return per_event, events[0], sim, books


@pytest.mark.skipif(not Path("/proc/self/io").is_file(), reason="needs Linux's /proc/self/io")
def test_bytes_rank0_writes_per_event_do_not_grow_with_the_number_of_tasks(tmp_path):
    """16x the tasks (and ranks): each event may not cost rank 0 more bytes (a compaction, amortized over the
    lines appended since the one before, adds at most half their bytes). The whole scheduler.json written again
    on each save, end and eval made them grow with the tasks (1.7 MB an event at 1024 tasks); status.json
    written on each step did too."""
    small, small_events, _, _ = _books_run(16, tmp_path / "small")
    large, large_events, sim, books = _books_run(256, tmp_path / "large")
    status_bytes, status_writes = books.status_writes
    print(f"rank 0 writes {small:.0f} B/event at 16 tasks ({small_events} events), {large:.0f} at 256 "
          f"({large_events} events); status.json {status_writes} times in {sim.queue.now:.1f} simulated s, "
          f"{status_bytes / max(status_writes, 1):.0f} B each")
    assert large < 1.3 * small, (small, large)
    assert status_writes <= sim.queue.now / StatusBoard.PERIOD_S + 1
    assert books.records.journal.appended < large_events, "compactions happened, amortized in the figure"
    books.close({"started": 0.0, "wall_time_s": sim.queue.now, "ended": "finished"}, finished=False)
    state = load_job_checkpoint(tmp_path / "large")
    assert {t: e["saved"]["version"] for t, e in state["tasks"].items()} == \
        {t: s.version for t, s in sim.scheduler.tasks.items()}, "the records a resume reads are every task's last"
    audit = (tmp_path / "large" / "audit.jsonl").read_text().splitlines()
    assert len(audit) == sum(s.trained_groups * s.spec.algo.group_size for s in sim.scheduler.tasks.values())


class _Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_status_json_is_rewritten_at_most_once_a_second_encoding_only_changed_tasks(tmp_path):
    from bench_sim import simulation

    sim = simulation(64, "async", 2, load_workload(ROOT / "configs/workloads/tiny-cpu.yaml"))
    sim.run()
    clock = _Clock()
    board = StatusBoard(tmp_path, JobConfig.load(ROOT / "configs" / "calib-small.yaml"), sim.scheduler, 90.0, clock)
    for task_id in sim.scheduler.tasks:
        board.changed(task_id)
    assert board.due()
    board.refresh()
    status = json.loads((tmp_path / "status.json").read_text())
    assert list(status["tasks"]) == list(sim.scheduler.tasks) and status["elapsed_s"] == 10.0
    assert status["tasks"]["add"]["steps_done"] == 2 and status["finished"] is True
    assert board.encoded == 64
    board.changed("add")
    board.changed("count")
    clock.now += 0.5
    assert not board.due(), "not twice within PERIOD_S"
    clock.now += 0.5
    assert board.due()
    board.refresh()
    assert board.encoded == 66, "the two tasks that changed, not the 64"
    clock.now += 5
    assert not board.due(), "nothing changed: nothing to write"
