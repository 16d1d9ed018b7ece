"""A serving job end to end (mpirun, local mode): tasks added while it runs, one queued for a free adapter
slot, one cancelled (keeps its last adapter), bad specs refused without disturbing it, `tasks close` ends
it; then `marlaas report` on the run dir it leaves."""
import json
import statistics
import subprocess
import sys
import time

import pytest
import yaml

from marlaas_hpc.runtime.retention import RetentionConfig
from support.jobs import ROOT, job_env, live_tasks, marlaas, wait_for

pytestmark = [pytest.mark.mpi, pytest.mark.slow]


JOB = {"model": "tiny", "engine": "hf", "mode": "async", "max_adapters": 2, "rollout_slots": 4, "serve_idle_s": 300,
       "layout": {"env_ranks": 1, "rollout_ranks": 1, "trainer_tp": 1},
       "tenant_quotas": {"default": {"max_tasks": 3}, "mallory": {"max_total_steps": 5}},
       "tasks": [{"task_id": "base", "tenant": "alice", "total_steps": 6, "max_staleness": 1,
                  "dataset": {"kind": "addition", "eval_size": 8},
                  "algo": {"group_size": 4, "batch_prompts": 4, "lr": 0.003, "max_new_tokens": 6}}]}


def added(task_id, tenant, kind, steps, tokens):
    return {"task_id": task_id, "tenant": tenant, "total_steps": steps, "max_staleness": 1,
            "dataset": {"kind": kind, "eval_size": 8}, "lora": {"rank": 4, "alpha": 8},
            "algo": {"group_size": 4, "batch_prompts": 4, "lr": 0.003, "max_new_tokens": tokens}}


def diverging(task_id, tenant):
    """A legal spec whose adapter blows up (inf/NaN logits after a step or two): it must fail alone. The KL term
    makes every row count in the trainer, so the first step after the blow-up fails whatever the rewards: without
    it, rows whose group got one reward are skipped (trainer `_contributes`), and a garbage adapter's groups all
    score 0, so the task could end 'done' by chance."""
    spec = added(task_id, tenant, "addition", 6, 6)
    spec["algo"].update(lr=1e30, grad_clip=0.0, kl_beta=0.05)
    return spec


@pytest.fixture(scope="module")
def serving_run(tmp_path_factory):
    """Runs the scenario once; returns what the tests check (the run dir and what was observed on the way)."""
    tmp = tmp_path_factory.mktemp("serving")
    (tmp / "job.yaml").write_text(yaml.safe_dump(JOB))
    run_dir = tmp / "run"
    started = time.time()
    job = subprocess.Popen([sys.executable, "-m", "marlaas_hpc.cli", "run", str(tmp / "job.yaml"), "--run-dir",
                            str(run_dir)], cwd=ROOT, env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True)
    seen = {"refusals": {}}
    try:
        wait_for(lambda: (run_dir / "job.json").is_file(), 600, "the job to start", job)
        seen["startup_s"] = time.time() - started
        for spec in (added("long", "bob", "reverse", 40, 8), added("q1", "carol", "count", 3, 4),
                     added("q2", "dave", "sort", 3, 8), diverging("blowup", "eve")):
            path = tmp / f"{spec['task_id']}.yaml"
            path.write_text(yaml.safe_dump(spec))
            proc = marlaas("tasks", "add", path, "--run", run_dir)
            assert proc.returncode == 0, proc.stderr
        seen["added_at"] = time.time()
        seen["ls_after_add"] = marlaas("tasks", "ls", "--run", run_dir).stdout
        for name, spec in bad_specs(tmp).items():
            path = tmp / f"bad-{name}.yaml"
            path.write_text(yaml.safe_dump(spec))
            proc = marlaas("tasks", "add", path, "--run", run_dir)
            seen["refusals"][name] = (proc.returncode, proc.stderr)
        # a spec dropped by hand, bypassing `tasks add`: rank 0 checks the quota itself
        hand = added("m2", "mallory", "addition", 6, 6)
        (run_dir / "queue" / f"{time.time_ns():020d}-m2.json").write_text(json.dumps({"spec": hand, "added_at": 0}))
        wait_for(lambda: live_tasks(run_dir).get("long", {}).get("steps_done", 0) >= 1, 600, "long's first step", job)
        proc = marlaas("tasks", "cancel", "long", "--run", run_dir)
        assert proc.returncode == 0, proc.stderr
        seen["cancelled_at"] = time.time()
        wait_for(lambda: all(live_tasks(run_dir).get(t, {}).get("status") in ("done", "failed", "cancelled")
                             for t in ("base", "long", "q1", "q2", "blowup")), 900, "every task to end", job)
        time.sleep(2.0)  # serving: the job must still be up, idle, waiting for more tasks
        seen["alive_while_serving"] = job.poll() is None
        assert marlaas("tasks", "close", "--run", run_dir).returncode == 0
        seen["closed_at"] = time.time()
        out, _ = job.communicate(timeout=300)
        seen.update(returncode=job.returncode, stdout=out, exited_at=time.time())
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    return run_dir, seen


def bad_specs(tmp):
    outside = tmp.parent / "elsewhere.jsonl"  # outside the config's dir, the run dir and the fixtures
    outside.write_text('{"question": "1+1?", "answer": "#### 2"}\n')
    good = added("okname", "eve", "addition", 2, 6)
    return {"unknown field": {**good, "epochs": 3},
            "wrong type": {**good, "total_steps": "many"},
            "tenant traversal": {**good, "tenant": "../alice"},
            "task id traversal": {**good, "task_id": "../../base"},
            "duplicate task id": {**good, "task_id": "base"},
            "other base model": {**good, "base_model": "/models/Qwen3-32B"},
            "data outside roots": {**good, "dataset": {"kind": "gsm8k", "path": str(outside)}},
            "quota": {**good, "tenant": "mallory", "total_steps": 6}}


def test_tasks_added_to_a_running_job_queue_cancel_and_complete(serving_run):
    run_dir, seen = serving_run
    assert seen["returncode"] == 0, seen["stdout"][-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    tasks = summary["tasks"]
    assert {t: s["status"] for t, s in tasks.items()} == {"base": "done", "long": "cancelled", "q1": "done",
                                                          "q2": "done", "blowup": "failed"}
    assert "non-finite loss" in tasks["blowup"]["error"], tasks["blowup"]
    # with two adapter slots taken by base and long, the added q1/q2 wait queued
    states = {line.split()[0]: line.split()[2] for line in seen["ls_after_add"].splitlines()[1:]}
    assert states["q2"] == "queued", seen["ls_after_add"]
    # the cancelled task stopped at a step boundary and keeps what the default retention policy keeps of its
    # versions (the newest two, every 10th, and its last version)
    long = tasks["long"]
    assert 1 <= long["steps_done"] < 40
    adapters = sorted(p.name for p in (run_dir / "tasks/bob/long/adapters").iterdir())
    last, policy = long["steps_done"], RetentionConfig()
    assert adapters == [f"v{v:04d}" for v in range(last + 1) if policy.keeps(v, last)]
    assert (run_dir / "tasks/bob/long/adapters" / adapters[-1] / "adapter_model.safetensors").is_file()
    # never more than max_adapters=2 tasks between first and last step at once (queued ones start as slots free)
    spans = {t: step_times(run_dir, tasks[t]["tenant"], t) for t in tasks if tasks[t]["steps_done"] > 0}
    for t, (first, _) in spans.items():
        overlapping = [u for u, (a, b) in spans.items() if a <= first <= b]
        assert len(overlapping) <= 2, (t, spans)
    assert spans["q1"][0] > min(spans["base"][1], spans["long"][1]), "q1 started only after a slot freed"
    for task_id in ("long", "q1", "q2"):
        assert tasks[task_id]["ttfs_s"] is not None and tasks[task_id]["ttfs_s"] > 0
        assert tasks[task_id]["steps_done"] == len(spans_lines(run_dir, tasks[task_id]["tenant"], task_id))
    median = statistics.median(tasks[t]["ttfs_s"] for t in ("long", "q1", "q2"))
    print(f"\nTTFS of tasks added to a busy job: " + ", ".join(f"{t} {tasks[t]['ttfs_s']:.1f} s" for t in
          ("long", "q1", "q2")) + f"; median {median:.1f} s (job start-up {seen['startup_s']:.0f} s)")
    # serving: up while idle, ended promptly by `tasks close`
    assert seen["alive_while_serving"]
    assert seen["exited_at"] - seen["closed_at"] < 60
    queue = run_dir / "queue"
    assert not list(queue.glob("*.json")), "no pending file left behind"
    assert len(list((queue / "accepted").glob("*.json"))) == 4


def test_bad_specs_refused_and_the_job_unaffected(serving_run):
    run_dir, seen = serving_run
    words = {"unknown field": "epochs: unknown field", "wrong type": "total_steps: expected an integer",
             "tenant traversal": "tenant:", "task id traversal": "task_id:",
             "duplicate task id": "task id 'base' is already used", "other base model": "base_model:",
             "data outside roots": "outside the job's allowed data roots", "quota": "max_total_steps=5"}
    for name, (code, stderr) in seen["refusals"].items():
        assert code == 2 and "refused, nothing queued" in stderr and words[name] in stderr, (name, stderr)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert set(summary["tasks"]) == {"base", "long", "q1", "q2", "blowup"}
    assert summary["rejected"] == {"m2": rejected_reason(run_dir)}
    (rejected,) = [json.loads(p.read_text()) for p in (run_dir / "queue" / "rejected").glob("*.json")]
    assert rejected["spec"]["task_id"] == "m2" and "max_total_steps=5" in rejected["reason"]
    assert summary["tasks"]["base"]["steps_done"] == 6


def rejected_reason(run_dir):
    (record,) = [json.loads(p.read_text()) for p in (run_dir / "queue" / "rejected").glob("*.json")]
    return record["reason"]


def spans_lines(run_dir, tenant, task_id):
    return (run_dir / "tasks" / tenant / task_id / "metrics.jsonl").read_text().splitlines()


def step_times(run_dir, tenant, task_id):
    times = [json.loads(line)["time"] for line in spans_lines(run_dir, tenant, task_id)]
    return min(times), max(times)


def test_report_of_the_serving_run(serving_run, tmp_path):
    import matplotlib.image as mpimg

    run_dir, seen = serving_run
    assert seen["returncode"] == 0
    proc = marlaas("report", run_dir, "-o", tmp_path / "report")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    text = (tmp_path / "report" / "report.md").read_text()
    assert f"- wall time: {summary['wall_time_s']:.3f} s" in text
    for role, fraction in summary["busy_fraction"].items():
        assert f"{role} {fraction:.3f}" in text
    rows = {cells[0]: cells for cells in
            ([c.strip() for c in line.strip("|").split("|")] for line in text.splitlines() if line.startswith("| "))}
    keys = ("base_model", "status", "steps_done", "staleness_bound", "reward_first", "reward_last",
            "eval_accuracy_before", "eval_accuracy_after", "ttfs_s", "tpts_s")
    for task_id, task in summary["tasks"].items():
        expected = [task_id, task["tenant"]] + [f"{task[k]:.3f}" if isinstance(task[k], float) else
                                                ("-" if task[k] is None else str(task[k])) for k in keys]
        assert rows[task_id] == expected
    for name in ("reward_curves", "utilisation_gantt", "ttfs_tpts"):
        image = mpimg.imread(tmp_path / "report" / f"{name}.png")
        assert image.shape[0] > 200 and image.shape[1] > 400
        colours = {tuple(px) for px in image[::7, ::7, :3].reshape(-1, 3).round(2).tolist()}
        assert len(colours) > 10, f"{name}.png is not blank"
        assert f"({name}.png)" in text


def test_tensorboard_events_mirror_metrics_jsonl(serving_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, _ = serving_run
    task = run_dir / "tasks" / "carol" / "q1"
    assert list(task.glob("events.out.tfevents.*"))
    events = EventAccumulator(str(task))
    events.Reload()
    rewards = [(e.step, e.value) for e in events.Scalars("train/reward_mean")]
    metrics = [json.loads(line) for line in (task / "metrics.jsonl").read_text().splitlines()]
    assert rewards == [(m["version"], pytest.approx(m["reward_mean"])) for m in metrics]
