"""Multi-turn tool episodes in the distributed runtime (mpirun, HF engine, tiny model), next to a single-turn
task: tool tokens never trained, every turn of an episode on the version of its first turn even when newer
versions land mid-episode, max-turn / max-token limits ending episodes with reward 0, and a multi-turn task
whose reward function returns NaN failing alone."""
import json

import pytest

from support.jobs import run_marlaas

pytestmark = [pytest.mark.mpi, pytest.mark.slow]

LOOKUP_ALGO = {"group_size": 4, "batch_prompts": 4, "lr": 0.003, "max_new_tokens": 6, "max_turns": 3,
               "max_episode_tokens": 40}


def _lookup(task_id, steps, algo=None, **dataset):
    return {"task_id": task_id, "tenant": "tools", "total_steps": steps, "max_staleness": 2,
            "dataset": {"kind": "lookup", "eval_size": 16, **dataset}, "lora": {"rank": 8, "alpha": 16},
            "algo": {**LOOKUP_ALGO, **(algo or {})}}


def job_config():
    return {
        "model": "tiny", "engine": "hf", "mode": "async", "rollout_slots": 6,
        "layout": {"env_ranks": 1, "rollout_ranks": 1, "trainer_tp": 1},
        "env_pool": {"mode": "thread", "workers": 8, "step_timeout_s": 20},
        "tasks": [
            # a slow tool: trainer steps (new versions) land while episodes wait on it
            _lookup("lookup", 4, tool_latency_s=0.5),
            _lookup("short_turns", 2, {"max_turns": 1}),       # any tool call hits max_turns
            _lookup("short_tokens", 2, {"max_episode_tokens": 12}),  # no observation fits the budget
            _lookup("nan_reward", 2, reward_fn="nan_reward.py:reward"),  # a file; the fixture makes it absolute
            {"task_id": "add", "tenant": "plain", "total_steps": 3, "max_staleness": 1,
             "dataset": {"kind": "addition", "eval_size": 16}, "lora": {"rank": 8, "alpha": 16},
             "algo": {"group_size": 4, "batch_prompts": 4, "lr": 0.003, "max_new_tokens": 6}},
        ]}


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, tiny_model_path):
    tmp_path = tmp_path_factory.mktemp("envrun")
    (tmp_path / "nan_reward.py").write_text("def reward(sample, completion):\n    return float('nan')\n")
    config = job_config()
    config["tasks"][3]["dataset"]["reward_fn"] = f"{tmp_path / 'nan_reward.py'}:reward"
    proc, run_dir = run_marlaas(config, tmp_path, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    timeline = [json.loads(line) for path in sorted((run_dir / "timeline").glob("rank*.jsonl"))
                for line in path.read_text().splitlines()]
    return run_dir, summary, timeline


def _episodes(timeline, task_id, eval=False):
    return [r for r in timeline if r["stage"] == "episode" and r["tasks"] == [task_id] and r["eval"] == eval]


def test_tasks_finish_and_bad_reward_fails_alone(finished_run):
    _, summary, _ = finished_run
    tasks = summary["tasks"]
    assert tasks["nan_reward"]["status"] == "failed"
    assert "nan" in tasks["nan_reward"]["error"] and "outside [0, 1]" in tasks["nan_reward"]["error"]
    for task_id, steps in (("lookup", 4), ("short_turns", 2), ("short_tokens", 2), ("add", 3)):
        assert tasks[task_id]["status"] == "done" and tasks[task_id]["steps_done"] == steps, task_id
        assert tasks[task_id]["eval_accuracy_before"] is not None and tasks[task_id]["eval_accuracy_after"] is not None


def test_tool_tokens_are_never_trained(finished_run):
    """Per optimizer step, the trainer's trained-token count equals the model tokens of the step's episodes
    (from the env rank's records); their tool tokens are not in it."""
    run_dir, _, timeline = finished_run
    episodes = _episodes(timeline, "lookup")
    by_group: dict[str, list] = {}
    for record in episodes:
        by_group.setdefault(record["group_id"], []).append(record)
    audit = [json.loads(line) for line in (run_dir / "audit.jsonl").read_text().splitlines()]
    metrics = [json.loads(line) for line in (run_dir / "tasks/tools/lookup/metrics.jsonl").read_text().splitlines()]
    tool_tokens_trained_around = 0
    for step in metrics:
        groups = {r["group_id"] for r in audit if r["task_id"] == "lookup" and r["trained_into"] == step["version"]}
        members = [e for g in groups for e in by_group[g]]
        assert len(members) == 4 * 4
        assert step["tokens"] == sum(e["model_tokens"] for e in members)
        tool_tokens_trained_around += sum(e["tool_tokens"] for e in members)
    assert tool_tokens_trained_around > 0, "some trained episodes called the tool (else the check is empty)"
    print(f"\n[env-runtime] lookup: {tool_tokens_trained_around} tool tokens in trained episodes, none trained")


def test_every_turn_keeps_the_first_turns_version(finished_run):
    _, _, timeline = finished_run
    multi = [e for e in _episodes(timeline, "lookup") if e["turns"] > 1]
    assert multi, "some episodes used the tool"
    for episode in multi:
        assert len(set(episode["turn_versions"])) == 1, episode
    overtaken = [e for e in multi if any(newest is not None and newest > version for newest, version
                                         in zip(e["newest_versions"][1:], e["turn_versions"][1:]))]
    print(f"\n[env-runtime] {len(multi)} multi-turn episodes, {len(overtaken)} sampled a later turn after a "
          "newer version had arrived: all stayed on their first turn's version")
    assert overtaken, "a newer version arrived mid-episode at least once (the pin was exercised)"


def test_limits_end_episodes_with_reward_zero(finished_run):
    _, summary, timeline = finished_run
    for task_id, reason in (("short_turns", "max_turns"), ("short_tokens", "max_tokens")):
        episodes = _episodes(timeline, task_id) + _episodes(timeline, task_id, eval=True)
        called = [e for e in episodes if e["tool_calls"] > 0]
        assert called, f"{task_id}: the base policy samples tool calls"
        for episode in called:
            assert episode["finish"] == reason and episode["reward"] == 0.0 and episode["turns"] == 1, episode
        assert all(e["finish"] == "answer" for e in episodes if e["tool_calls"] == 0)
    for episode in _episodes(timeline, "short_tokens"):
        assert episode["prompt_tokens"] + episode["model_tokens"] + episode["tool_tokens"] <= 12
    env = next(iter(summary["env_ranks"].values()))
    assert env["episodes"]["short_turns"]["train"]["finish"].get("max_turns", 0) > 0


def test_env_rank_reports_stage_latencies(finished_run):
    _, summary, timeline = finished_run
    env = next(iter(summary["env_ranks"].values()))
    stages = env["pool"]["stages"]
    assert stages["tool:lookup"]["count"] > 0 and stages["reward"]["count"] > 0
    assert stages["tool:lookup"]["max"] >= 0.5  # the lookup task's simulated latency
    lookup = env["episodes"]["lookup"]
    assert 0 < lookup["train"]["tool_call_rate"] <= 1 and lookup["train"]["episodes"] >= 4 * 4 * 4
    steps = [r for r in timeline if r["stage"] == "env_step"]
    assert any(r.get("tool:lookup", 0) >= 0.5 for r in steps)  # slow steps have timeline records
    scores = [r for r in timeline if r["stage"] == "score" and r["tasks"] == ["lookup"]]
    assert {r["turn"] for r in scores} >= {1, 2} and all(r["end"] >= r["start"] for r in scores)
    groups = [r for r in timeline if r["stage"] == "group" and r["tasks"] == ["lookup"] and not r["eval"]]
    assert groups and all(len(g["completion_tokens"]) == 4 for g in groups)
    print("\n[env-runtime] lookup tool p50/p90/p99 "
          + "/".join(f"{stages['tool:lookup'][q] * 1e3:.1f}" for q in ("p50", "p90", "p99")) + " ms, reward p50 "
          f"{stages['reward']['p50'] * 1e3:.2f} ms; lookup tool-call rate (train) {lookup['train']['tool_call_rate']:.2f}")
