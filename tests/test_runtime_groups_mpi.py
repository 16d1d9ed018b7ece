"""Trainer scale-out in the distributed runtime (mpirun, local mode, HF engine, tiny model):

- two trainer groups (layout.trainer_groups: 2) training four tasks: placement by tokens per step puts the heavy
  task alone on group 0 and the light ones on group 1; once the heavy one is done a light one moves to group 0
  (adapter and optimizer state handed over at a step boundary) and keeps training there; both groups train and
  broadcast their own tasks' deltas; summary.json names each task's group; the staleness audit holds per task;
- data parallelism inside a group (layout.trainer_dp: 2): both replicas train every step;
- preemption (USR2) and resume with two groups: every version trained exactly once, the bound holds.

The on-policy oracle checks every group's adapters against the rollout rank's: in a step whose samples all come
from the version being trained, trainer and rollout logprobs agree (metrics 'logp_diff_abs' ~ 1e-7); a moved task
that lost its state, or a DP replica with other weights, would break it."""
import collections
import json
from pathlib import Path

import pytest
import yaml

from support.jobs import ROOT, marlaas, preempt_after, run_marlaas

pytestmark = [pytest.mark.mpi, pytest.mark.slow]
ON_POLICY_TOL = 1e-4


def _task(task_id, tenant, kind, steps, k, batch=4, tokens=6, rank=8):
    return {"task_id": task_id, "tenant": tenant, "total_steps": steps, "max_staleness": k,
            "dataset": {"kind": kind, "eval_size": 8}, "lora": {"rank": rank, "alpha": 2 * rank},
            "algo": {"group_size": 4, "batch_prompts": batch, "lr": 0.003, "max_new_tokens": tokens}}


def groups_config():
    """configs/groups-demo.yaml. Estimated tokens per step: big 8 prompts x 4 samples x 8 tokens = 256, the others
    4 x 4 x 6 = 96 each. Least loaded first: big -> group 0; add -> 1 (96); count -> 1 (192 < 256); rev -> 1."""
    return yaml.safe_load((ROOT / "configs" / "groups-demo.yaml").read_text())


def _load(run_dir: Path, config: dict):
    summary = json.loads((run_dir / "summary.json").read_text())
    audit = [json.loads(line) for line in (run_dir / "audit.jsonl").read_text().splitlines()]
    timeline = [json.loads(line) for path in sorted((run_dir / "timeline").glob("rank*.jsonl"))
                for line in path.read_text().splitlines()]
    tenants = {t["task_id"]: t["tenant"] for t in config["tasks"]}
    metrics = {t: [json.loads(line) for line in (run_dir / "tasks" / tenants[t] / t / "metrics.jsonl").read_text()
                   .splitlines()] for t in tenants}
    return summary, audit, timeline, metrics


def _check_versions_bound_and_oracle(config, summary, audit, metrics):
    for task in config["tasks"]:
        task_id, steps, k = task["task_id"], task["total_steps"], task["max_staleness"]
        info = summary["tasks"][task_id]
        assert info["status"] == "done" and info["steps_done"] == steps, (task_id, info)
        assert [m["version"] for m in metrics[task_id]] == list(range(1, steps + 1)), "each version once"
        rows = [r for r in audit if r["task_id"] == task_id]
        per_version = collections.Counter(r["trained_into"] for r in rows)
        assert per_version == {v: task["algo"]["batch_prompts"] * 4 for v in range(1, steps + 1)}
        for row in rows:
            assert row["trained_into"] - 1 - k <= row["behaviour_version"] <= row["trained_into"] - 1
        for m in metrics[task_id]:
            if m["staleness_max"] == 0:
                assert m["logp_diff_abs"] < ON_POLICY_TOL, (task_id, m["version"], m["logp_diff_abs"])


def _trained_by_rank(timeline) -> dict[int, set[str]]:
    out: dict[int, set[str]] = {}
    for span in timeline:
        if span["role"] == "trainer" and span["stage"] == "train":
            out.setdefault(span["rank"], set()).update(span["tasks"])
    return out


@pytest.fixture(scope="module")
def groups_run(tmp_path_factory, tiny_model_path):
    tmp_path = tmp_path_factory.mktemp("groups")
    config = groups_config()
    proc, run_dir = run_marlaas(config, tmp_path, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return config, proc, run_dir, *_load(run_dir, config)


def test_two_groups_train_four_tasks_with_placement_by_tokens(groups_run):
    config, proc, run_dir, summary, audit, timeline, metrics = groups_run
    _check_versions_bound_and_oracle(config, summary, audit, metrics)
    groups = summary["trainer_groups"]
    assert sorted(groups) == ["0", "1"] and groups["0"]["ranks"] == [3] and groups["1"]["ranks"] == [4]
    assert all(g["busy_fraction"] > 0 for g in groups.values())
    trained = _trained_by_rank(timeline)
    assert "big" in trained[3] and "big" not in trained[4], "the heavy task alone on group 0"
    assert {"add", "count", "rev"} <= trained[4], "the light ones start together on group 1"
    assert {t: s["trainer_group"] for t, s in summary["tasks"].items()}["big"] == 0
    # every group's leader broadcast its own tasks' versions: rollout rank 2 loaded every version of each task
    loaded = collections.Counter(s["tasks"][0] for s in timeline if s["rank"] == 2 and s["stage"] == "load_delta")
    assert loaded == {t["task_id"]: t["total_steps"] + 1 for t in config["tasks"]}


def test_a_task_moves_to_the_idle_group_and_keeps_training(groups_run):
    """Once 'big' is measured, group 1 (three light tasks) outweighs group 0: light tasks move there, each at a
    step boundary, and keep training. How many move depends on the measured tokens per step (sampled lengths),
    so every move is checked, not a count."""
    config, proc, run_dir, summary, audit, timeline, metrics = groups_run
    moved = {t: s["trainer_moves"] for t, s in summary["tasks"].items() if s["trainer_moves"]}
    assert moved and "big" not in moved, summary["tasks"]
    leader = {0: 3, 1: 4}
    outs = [s for s in timeline if s["stage"] == "move_out"]
    ins = [s for s in timeline if s["stage"] == "move_in"]
    assert len(outs) == len(ins) == sum(moved.values())
    trained = _trained_by_rank(timeline)
    for task_id in moved:
        group = summary["tasks"][task_id]["trainer_group"]
        assert f"[{task_id}] moves from trainer group {1 - group} to {group}" in proc.stdout
        assert [s["rank"] for s in outs if task_id in s["tasks"]][-1] == leader[1 - group]
        last_in = [s for s in ins if task_id in s["tasks"]][-1]
        assert last_in["rank"] == leader[group]
        # it trained on its old group before the move and on its new one after it, every version once
        assert task_id in trained[3] and task_id in trained[4]
        after = [s for s in timeline if s["rank"] == leader[group] and s["stage"] == "train" and task_id in s["tasks"]
                 and s["start"] >= last_in["end"]]
        assert after, f"{task_id} trained on group {group} after it moved there"
    # the report labels the trainer rows of the Gantt chart by group
    from marlaas_hpc.report.load import load_run
    from marlaas_hpc.report.plots import _group_label

    run = load_run(run_dir)
    assert [_group_label(run, "trainer", rank) for rank in (3, 4)] == [" g0", " g1"]


def test_data_parallel_group_trains_on_both_replicas(tmp_path, tiny_model_path):
    config = {"model": "tiny", "engine": "hf", "mode": "async", "rollout_slots": 4,
              "layout": {"env_ranks": 1, "rollout_ranks": 1, "trainer_tp": 1, "trainer_dp": 2},
              "tasks": [_task("add", "alice", "addition", 3, 0), _task("sort", "bob", "sort", 3, 1, tokens=7)]}
    proc, run_dir = run_marlaas(config, tmp_path, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary, audit, timeline, metrics = _load(run_dir, config)
    _check_versions_bound_and_oracle(config, summary, audit, metrics)
    delta = summary["trainer_groups"]["0"].pop("delta")
    assert summary["trainer_groups"]["0"].pop("regroups") == [], "no step failed on a rank"
    assert summary["trainer_groups"] == {"0": {"ranks": [3, 4], "busy_fraction": pytest.approx(
        summary["busy_fraction"]["trainer"]), "tasks": ["add", "sort"]}}
    assert delta["sent"] == 2 * (3 + 1), delta  # the leader broadcast v0..v3 of each task once
    trained = _trained_by_rank(timeline)
    assert trained[3] == trained[4] == {"add", "sort"}, "both DP replicas take part in every step"


def test_preemption_and_resume_with_two_groups(tmp_path, tiny_model_path):
    steps = 10
    config = {"model": "tiny", "engine": "hf", "mode": "async", "rollout_slots": 4,
              "layout": {"env_ranks": 1, "rollout_ranks": 1, "trainer_tp": 1, "trainer_groups": 2},
              "tasks": [_task("add", "alice", "addition", steps, 0), _task("sort", "bob", "sort", steps, 2, tokens=7)],
              "adapters": {"keep_every": 1}}  # the checkpointed version's adapter is compared after the run
    config_path = tmp_path / "job.yaml"
    config_path.write_text(yaml.safe_dump(config))
    run_dir = tmp_path / "run"
    code, out = preempt_after(config_path, run_dir, steps=2)
    assert code == 75, out[-3000:]
    from marlaas_hpc.runtime.checkpoint import load_job_checkpoint

    saved = load_job_checkpoint(run_dir)
    versions = {t: r["saved"]["version"] for t, r in saved["tasks"].items()}
    assert all(2 <= v < steps for v in versions.values()), versions
    groups = {t: r["saved"]["trainer_group"] for t, r in saved["tasks"].items()}
    assert sorted(groups.values()) == [0, 1], "each group saved the task it owns"
    adapter_bytes = {}
    for task in config["tasks"]:
        task_dir = run_dir / "tasks" / task["tenant"] / task["task_id"]
        assert (task_dir / "checkpoint" / f"tp0-v{versions[task['task_id']]:06d}.pt").is_file()
        adapter_bytes[task["task_id"]] = (task_dir / "adapters" / f"v{versions[task['task_id']]:04d}" /
                                          "adapter_model.safetensors").read_bytes()
    assert (run_dir / "checkpoint" / "trainer-rng-tp0.pt").is_file()
    assert (run_dir / "checkpoint" / "trainer-rng-g1-dp0-tp0.pt").is_file()

    resumed = marlaas("run", "--resume", str(run_dir), timeout=900)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    summary, audit, _, metrics = _load(run_dir, config)
    assert summary["preempted"] is False and len(summary["previous_runs"]) == 1
    _check_versions_bound_and_oracle(config, summary, audit, metrics)
    for task in config["tasks"]:
        rows = [r for r in audit if r["task_id"] == task["task_id"]]
        assert len({(r["group_id"], r["sample"]) for r in rows}) == len(rows), "no sample trained twice"
        task_dir = run_dir / "tasks" / task["tenant"] / task["task_id"]
        adapter = task_dir / "adapters" / f"v{versions[task['task_id']]:04d}" / "adapter_model.safetensors"
        assert adapter.read_bytes() == adapter_bytes[task["task_id"]], "resumed from the checkpointed adapter"
