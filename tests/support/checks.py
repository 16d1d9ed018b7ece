"""What many tests check the same way: the staleness bound and progress of a scheduler's audit, a run dir where
every version was trained exactly once, rollout ranks that followed rank 0's model pool, tensors compared."""
from __future__ import annotations

import bisect
import collections
import json
from pathlib import Path

import yaml

from marlaas_hpc.scheduler import DONE
from support.configs import MODEL_OF
from support.jobs import rank_timelines


def assert_bound_and_progress(scheduler, result, specs) -> None:
    """A simulated run: every task finished, each version trained once from B groups within its bound."""
    assert result.ended == {s.task_id: DONE for s in specs}, "every task finishes (no starvation)"
    for s in specs:
        records = [r for r in scheduler.audit if r.task_id == s.task_id]
        assert len(records) == s.total_steps * s.algo.batch_prompts
        for record in records:
            assert record.behaviour_version >= record.trained_into - 1 - s.max_staleness, record
            assert record.behaviour_version <= record.trained_into - 1
        versions = sorted({r.trained_into for r in records})
        assert versions == list(range(1, s.total_steps + 1)), "each version trained exactly once"
        state = scheduler.tasks[s.task_id]
        assert state.max_trained_staleness <= s.max_staleness
        assert state.version == s.total_steps


def assert_pool_jobs_done(result, jobs) -> None:
    """A simulated model pool's jobs: every task done, none trained past its bound."""
    for job, outcome in zip(jobs, result.jobs):
        assert set(outcome.statuses.values()) == {"done"}, outcome
        assert outcome.staleness_violations == 0


def check_every_version_once(run_dir: Path, steps: int) -> dict:
    """A finished run dir: every task done, each of its `steps` versions trained from exactly B groups, no sample
    or prompt trained twice, the bound held. Returns summary.json."""
    summary = json.loads((run_dir / "summary.json").read_text())
    audit = [json.loads(line) for line in (run_dir / "audit.jsonl").read_text().splitlines()]
    config = yaml.safe_load((run_dir / "job.yaml").read_text())
    for task in config["tasks"]:
        task_id, group = task["task_id"], task["algo"]["batch_prompts"] * task["algo"]["group_size"]
        assert summary["tasks"][task_id]["status"] == "done", summary["tasks"][task_id]
        rows = [r for r in audit if r["task_id"] == task_id]
        assert collections.Counter(r["trained_into"] for r in rows) == {v: group for v in range(1, steps + 1)}
        assert len({(r["group_id"], r["sample"]) for r in rows}) == len(rows), "no sample trained twice"
        prompts = collections.Counter(r["group_id"].split("/g")[1].split(".r")[0] for r in rows)
        assert set(prompts.values()) == {task["algo"]["group_size"]}, "no prompt trained twice"
        for row in rows:
            assert row["trained_into"] - 1 - row["bound"] <= row["behaviour_version"] <= row["trained_into"] - 1
    return summary


def check_ended_with_its_summary(run_dir: Path, ended: float) -> None:
    """The job's processes ended (`ended`: when `marlaas run` exited) soon after its summary, not at ULFM's
    MPI_Finalize deadline: a rank late to its end (one destroying a retired delta channel with a broadcast abandoned
    on it) or MPI_Finalize's PMIx fence after a loss kept the survivors spinning in MPI_Finalize until the deadline
    killed them, ~30 s after the summary (runtime/delta/groups.py keep_till_exit, launch/mpi.py ASYNC_FINALIZE)."""
    from marlaas_hpc.runtime.process import FINALIZE_DEADLINE_S

    summary = json.loads((run_dir / "summary.json").read_text())
    lag = ended - (summary["job_start"] + summary["wall_time_s"])
    assert lag < FINALIZE_DEADLINE_S / 2, f"the job ended {lag:.1f} s after its summary"


def assignment_followed(run_dir: Path) -> dict[int, list[str]]:
    """Checks that each rollout rank followed rank 0's model pool: its engine switches are the switches rank 0
    ordered (Serve, answered Served with the switch's cost), in order, and every group it started (training and
    eval) is of the model it served then. Returns each rank's models in the order it served them."""
    timelines = rank_timelines(run_dir)
    rank0 = timelines["rank0"]
    out = {}
    for name, notes in timelines.items():
        if not notes or notes[0]["role"] != "rollout":
            continue
        rank = notes[0]["rank"]
        answers = [n for n in rank0 if n["stage"] == "served" and n["rollout_rank"] == rank]
        assert answers, f"rank 0 assigned rollout rank {rank} no model"
        ordered = [n["model"] for n in answers if n["sleep_s"] or n["wake_s"]]
        switches = [n for n in notes if n["stage"] == "switch"]
        assert [n["to_model"] for n in switches] == ordered, "the rank switched exactly when rank 0 said"
        ends = [n["end"] for n in switches]
        models = [answers[0]["model"]] + [n["to_model"] for n in switches]
        for group in (n for n in notes if n["stage"] == "group"):
            serving = models[bisect.bisect_right(ends, group["start"])]
            assert MODEL_OF[group["tasks"][0]] == serving, (group, serving)
        out[rank] = models  # (the first twice when rank 0's first Serve made the rank switch)
    return out


def max_diff(a: dict, b: dict) -> float:
    """The largest absolute difference between two dicts of tensors with the same keys."""
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)
