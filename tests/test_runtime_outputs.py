"""Rank 0's quiet-period line: a job that printed nothing for QuietLog.QUIET_S says where it stands, once per quiet
period, and says nothing while lines keep coming."""
from marlaas_hpc.runtime.outputs import QuietLog
from marlaas_hpc.scheduler import Admit, Generate, Scheduler, SchedulerConfig, StepDone, Submit
from marlaas_hpc.tasks import TaskSpec


def _scheduler_with_groups_in_flight():
    config = SchedulerConfig(mode="async", order="fair", rollout_ranks=(1,), env_ranks=(2,), rollout_slots=3,
                             max_adapters=4, trainer_slots=1)
    scheduler = Scheduler(config, clock=lambda: 0.0)
    commands = []
    for task_id in ("a", "b"):
        spec = TaskSpec.from_dict({"task_id": task_id, "total_steps": 2,
                                   "algo": {"batch_prompts": 2, "group_size": 2}})
        for admit in scheduler.handle(Submit(spec)):
            assert isinstance(admit, Admit)
            commands += scheduler.handle(StepDone(task_id, 0))  # the trainer published version 0
    assert any(isinstance(c, Generate) for c in commands)
    return scheduler


def test_quiet_log_prints_where_the_job_stands_after_a_silence():
    now, lines = [0.0], []
    log = QuietLog(lines.append, clock=lambda: now[0])
    scheduler = _scheduler_with_groups_in_flight()
    generating = sum(len(task.generating) for task in scheduler.tasks.values())
    assert generating > 0

    now[0] = QuietLog.QUIET_S - 1
    log.tick(scheduler)
    log("[a] v1/2 reward 0.5")  # a line resets the quiet period
    now[0] += QuietLog.QUIET_S - 1
    log.tick(scheduler)
    assert lines == ["[a] v1/2 reward 0.5"]

    now[0] += 1
    log.tick(scheduler)
    assert len(lines) == 2
    assert lines[1].startswith(f"[job] no news for {QuietLog.QUIET_S:.0f} s: 0/2 tasks ended, 0 steps trained")
    assert f"{generating} generating" in lines[1]
    log.tick(scheduler)  # once per quiet period, not on every loop turn
    assert len(lines) == 2
