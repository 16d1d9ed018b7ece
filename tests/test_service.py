"""The service layer without a job: spec checks (isolation, base model, duplicates, quotas), the queue's
atomic hand-over, `marlaas tasks add/cancel/close` refusals, and how long a serving job stays up."""
import json
import os
import sys
from pathlib import Path

import pytest
import yaml

from marlaas_hpc.cli import main as marlaas
from marlaas_hpc.config import JobConfig
from marlaas_hpc.service import IntakeRules, QueueIntake, TaskQueue, TaskRecord, check_spec
from marlaas_hpc.tasks import SpecError

GOOD = {"task_id": "t1", "tenant": "alice", "total_steps": 4, "dataset": {"kind": "addition", "eval_size": 8}}


def rules(tmp_path, **over):
    job = JobConfig.from_dict({"model": "tiny", "data_roots": [str(tmp_path / "data")], **over})
    return IntakeRules.from_job(job, tmp_path / "run")


def spec_with(**over):
    data = json.loads(json.dumps(GOOD))
    for key, value in over.items():
        if isinstance(value, dict):
            data.setdefault(key, {}).update(value)
        else:
            data[key] = value
    return data


@pytest.mark.parametrize("over, field, words", [
    ({"colour": "red"}, "colour", "unknown field"),
    ({"algo": {"batch_size": 3}}, "algo.batch_size", "unknown field"),
    ({"total_steps": "ten"}, "total_steps", "integer"),
    ({"lora": {"rank": 2.5}}, "lora.rank", "integer"),
    ({"tenant": "../bob"}, "tenant", "safe name"),
    ({"tenant": ".hidden"}, "tenant", "safe name"),
    ({"task_id": "a/b"}, "task_id", "safe name"),
    ({"task_id": ".."}, "task_id", "safe name"),
    ({"task_id": "x..y"}, "task_id", "safe name"),
    ({"base_model": "/models/Qwen3-8B"}, "base_model", "differs from the job's base model"),
    ({"lora": {"rank": 64}}, "lora.rank", "max_lora_rank"),
])
def test_bad_specs_name_their_field(tmp_path, over, field, words):
    with pytest.raises(SpecError) as err:
        check_spec(spec_with(**over), rules(tmp_path), [], tmp_path)
    assert err.value.field == field and words in str(err.value)


def test_duplicate_ids_collide_across_tenants_and_case(tmp_path):
    existing = [TaskRecord("T1", "bob", 4, "running")]
    with pytest.raises(SpecError, match="collides with 'T1'"):
        check_spec(spec_with(), rules(tmp_path), existing, tmp_path)
    with pytest.raises(SpecError, match="already used"):
        check_spec(spec_with(tenant="carol", task_id="T1"), rules(tmp_path), existing, tmp_path)


def test_data_paths_must_stay_under_allowed_roots(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "ok.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    (tmp_path / "secret.jsonl").write_text('{"prompt": "x", "answer": "y"}\n')
    (tmp_path / "data" / "m.py").write_text("def f(sample, completion):\n    return 1.0\n")
    os.symlink(tmp_path / "secret.jsonl", tmp_path / "data" / "link.jsonl")
    custom = {"kind": "custom", "reward_fn": "m.py:f"}
    spec = check_spec(spec_with(dataset={**custom, "path": "ok.jsonl"}), rules(tmp_path), [], tmp_path / "data")
    assert spec.dataset.path == str(tmp_path / "data" / "ok.jsonl"), "relative paths resolve against the spec's dir"
    for path in ("../secret.jsonl", "link.jsonl", str(tmp_path / "secret.jsonl")):
        with pytest.raises(SpecError) as err:
            check_spec(spec_with(dataset={**custom, "path": path}), rules(tmp_path), [], tmp_path / "data")
        assert err.value.field == "dataset.path" and "outside the job's allowed data roots" in str(err.value)
    with pytest.raises(SpecError, match="dataset.corpus"):
        check_spec(spec_with(dataset={"kind": "hotpotqa", "path": "ok.jsonl", "corpus": "/etc/passwd"}),
                   rules(tmp_path), [], tmp_path / "data")


def test_project_fixtures_and_run_dir_are_allowed(tmp_path):
    from marlaas_hpc.service.isolation import PROJECT_FIXTURES

    gsm8k = PROJECT_FIXTURES / "env" / "gsm8k_mini.jsonl"
    assert check_spec(spec_with(dataset={"kind": "gsm8k", "path": str(gsm8k)}), rules(tmp_path), [], tmp_path)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "d.jsonl").write_text("{}\n")
    assert check_spec(spec_with(dataset={"kind": "gsm8k", "path": "run/d.jsonl"}), rules(tmp_path), [], tmp_path)


def test_tenant_quotas(tmp_path):
    quotas = {"default": {"max_tasks": 2}, "mallory": {"max_total_steps": 10}}
    r = rules(tmp_path, tenant_quotas=quotas)
    two_live = [TaskRecord("a", "alice", 4, "running"), TaskRecord("b", "alice", 4, "pending")]
    with pytest.raises(SpecError, match="max_tasks=2"):
        check_spec(spec_with(), r, two_live, tmp_path)
    ended = [TaskRecord("a", "alice", 4, "done"), TaskRecord("b", "alice", 4, "cancelled")]
    assert check_spec(spec_with(), r, ended, tmp_path), "ended tasks free their place"
    with pytest.raises(SpecError) as err:
        check_spec(spec_with(tenant="mallory", total_steps=11), r, [], tmp_path)
    assert err.value.field == "total_steps" and "max_total_steps=10" in str(err.value)
    with pytest.raises(SpecError, match="max_total_steps=10"):
        check_spec(spec_with(tenant="mallory", total_steps=4), r, [TaskRecord("m", "mallory", 7, "done")], tmp_path)
    with pytest.raises(SpecError, match="tenant_quotas.bob.max_tasks"):
        JobConfig.from_dict({"tenant_quotas": {"bob": {"max_tasks": 0}}})
    with pytest.raises(SpecError, match="tenant_quotas.bob.max_jobs"):
        JobConfig.from_dict({"tenant_quotas": {"bob": {"max_jobs": 1}}})


def test_job_config_service_fields(tmp_path):
    with pytest.raises(SpecError, match="serve_idle_s"):
        JobConfig.from_dict({"serve_idle_s": -1})
    with pytest.raises(SpecError, match="data_roots"):
        JobConfig.from_dict({"data_roots": "/data"})
    (tmp_path / "job.yaml").write_text(yaml.safe_dump({"data_roots": ["shared", "/abs"]}))
    job = JobConfig.load(tmp_path / "job.yaml")
    assert job.data_roots == [str(tmp_path), str(tmp_path / "shared"), "/abs"]


def started_run(tmp_path, **over) -> "Path":
    """A run dir as rank 0 leaves it at start: job.json written, queue empty."""
    run = tmp_path / "run"
    IntakeRules.from_job(JobConfig.from_dict({"model": "tiny", **over}), run).save()
    return run


def write_spec(tmp_path, name="spec.yaml", **over):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(spec_with(**over)))
    return path


def test_tasks_add_queues_atomically_and_refuses_without_queueing(tmp_path, capsys):
    run = started_run(tmp_path)
    assert marlaas(["tasks", "add", str(write_spec(tmp_path)), "--run", str(run)]) == 0
    (pending,) = TaskQueue(run).pending()
    assert pending.data["spec"]["task_id"] == "t1" and pending.data["added_at"] > 0
    assert not [p for p in (run / "queue").iterdir() if p.name.startswith(".")], "no temporary file left"
    bad = [write_spec(tmp_path, "dup.yaml", tenant="bob"),                    # same id as the pending t1
           write_spec(tmp_path, "unknown.yaml", task_id="t2", gpus=4),
           write_spec(tmp_path, "trav.yaml", task_id="t3", tenant="../../etc"),
           write_spec(tmp_path, "model.yaml", task_id="t4", base_model="other"),
           write_spec(tmp_path, "nofile.yaml", task_id="t5", dataset={"kind": "gsm8k", "path": "missing.jsonl"})]
    for path in bad:
        assert marlaas(["tasks", "add", str(path), "--run", str(run)]) == 2
        assert "refused, nothing queued" in capsys.readouterr().err
    assert len(TaskQueue(run).pending()) == 1


def test_tasks_add_needs_a_started_open_job(tmp_path, capsys):
    spec = write_spec(tmp_path)
    assert marlaas(["tasks", "add", str(spec), "--run", str(tmp_path / "nothing")]) == 2
    assert "no job has started" in capsys.readouterr().err
    run = started_run(tmp_path)
    assert marlaas(["tasks", "close", "--run", str(run)]) == 0
    assert marlaas(["tasks", "add", str(spec), "--run", str(run)]) == 2
    assert "closed" in capsys.readouterr().err


def test_tasks_cancel_and_ls(tmp_path, capsys):
    run = started_run(tmp_path)
    assert marlaas(["tasks", "cancel", "ghost", "--run", str(run)]) == 2
    marlaas(["tasks", "add", str(write_spec(tmp_path)), "--run", str(run)])
    assert marlaas(["tasks", "cancel", "t1", "--run", str(run)]) == 0
    assert TaskQueue(run).cancel_requests() == ["t1"]
    capsys.readouterr()
    assert marlaas(["tasks", "ls", "--run", str(run)]) == 0
    row = capsys.readouterr().out.splitlines()[1].split()
    assert row[:3] == ["t1", "alice", "queued"]
    # rank 0 took it (pending -> accepted) and has not yet written it into status.json: still listed, once
    queue = TaskQueue(run)
    queue.accept(queue.pending()[0])
    (run / "status.json").write_text(json.dumps({"tasks": {}}))
    assert marlaas(["tasks", "ls", "--run", str(run)]) == 0
    rows = [line.split()[:3] for line in capsys.readouterr().out.splitlines()[1:]]
    assert rows == [["t1", "alice", "queued"]]


def test_rank0_intake_accepts_rejects_and_moves_every_file(tmp_path):
    from marlaas_hpc.scheduler import Scheduler, SchedulerConfig, Submit
    from marlaas_hpc.tasks import TaskSpec

    now = [100.0]
    job = JobConfig.from_dict({"tenant_quotas": {"mallory": {"max_total_steps": 3}}})
    intake = QueueIntake(job, tmp_path / "run", poll_s=0.5, clock=lambda: now[0])
    queue = TaskQueue(tmp_path / "run")
    scheduler = Scheduler(SchedulerConfig(), clock=lambda: now[0])
    scheduler.handle(Submit(TaskSpec.from_dict({"task_id": "running"})))
    queue.add(spec_with())
    queue.add(spec_with(task_id="running"))                       # dropped by hand: duplicate
    queue.add(spec_with(task_id="m1", tenant="mallory"))          # 4 steps > quota 3
    (queue.root / "garbage.json").write_text("{not json")
    assert intake.due() and not intake.due(), "scans are rate-limited"
    taken = intake.take(scheduler.tasks)
    assert [(spec is not None, reason is None) for _, spec, reason in taken] == \
        [(True, True), (False, False), (False, False), (False, False)]
    for entry, spec, reason in taken:
        intake.settle(entry, reason)
    assert queue.pending() == []
    assert len(queue.records("accepted")) == 1
    reasons = sorted(r["reason"] for r in queue.records("rejected"))
    assert any("already used" in r for r in reasons) and any("max_total_steps=3" in r for r in reasons)
    assert any("unreadable" in r for r in reasons)


def test_serving_job_waits_for_idle_or_close(tmp_path):
    now = [0.0]
    run = tmp_path / "run"
    assert not QueueIntake(JobConfig.from_dict({}), run, clock=lambda: now[0]).keep_serving(), "default: no serving"
    intake = QueueIntake(JobConfig.from_dict({"serve_idle_s": 10}), run, clock=lambda: now[0])
    assert intake.keep_serving()
    now[0] = 9.0
    assert intake.keep_serving()
    TaskQueue(run).add(spec_with())
    intake.take({})  # a new spec restarts the idle clock
    now[0] = 15.0
    assert intake.keep_serving()
    TaskQueue(run).close()
    now[0] = 16.0
    assert intake.due() and not intake.keep_serving(), "closed: stop at once"


def test_tasks_add_refuses_a_finished_job_but_not_a_reused_run_dir(tmp_path, capsys):
    run = started_run(tmp_path)
    (run / "summary.json").write_text("{}")
    assert marlaas(["tasks", "add", str(write_spec(tmp_path)), "--run", str(run)]) == 2
    assert "has finished" in capsys.readouterr().err
    os.utime(run / "summary.json", (1, 1))  # an older job's summary; the running job wrote job.json after it
    TaskQueue(run).close()
    QueueIntake(JobConfig.from_dict({}), run)  # a new job starting in the dir: the old stop marker goes
    assert marlaas(["tasks", "add", str(write_spec(tmp_path)), "--run", str(run)]) == 0


def test_example_serving_config_and_spec_are_valid(tmp_path):
    root = Path(__file__).resolve().parents[1]
    job = JobConfig.load(root / "configs" / "serve-demo.yaml")
    assert job.serve_idle_s > 0 and job.tenant_quotas["default"].max_tasks == 2
    spec = yaml.safe_load((root / "configs" / "tasks" / "reverse-bob.yaml").read_text())
    assert check_spec(spec, IntakeRules.from_job(job, tmp_path), [], root / "configs" / "tasks").tenant == "bob"
    spec = yaml.safe_load((root / "configs" / "tasks" / "sums-carol.yaml").read_text())
    checked = check_spec(spec, IntakeRules.from_job(job, tmp_path), [], root / "configs" / "tasks")
    assert checked.dataset.reward_fn == f"{root / 'configs' / 'tasks' / 'sums_reward.py'}:score"
    from marlaas_hpc.env.tenant_code import check_reward_code
    from marlaas_hpc.env import build_task_data

    check_reward_code(checked.dataset, job.sandbox)  # loads in a sandboxed worker
    task = build_task_data(checked.dataset, sandbox=job.sandbox)
    sample = task.train_sample(0)
    assert task.reward(sample, sample.answer) == 1.0 and task.reward(sample, "x") == 0.0


def test_reward_files_resolve_next_to_the_spec_and_stay_under_allowed_roots(tmp_path):
    """FILE.py:FUNCTION is relative to the spec and must lie under the data roots; module names are refused
    (tenant code is a file, never an installed module), and nothing of it is imported by the check."""
    (tmp_path / "data" / "sub").mkdir(parents=True)
    (tmp_path / "data" / "d.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    (tmp_path / "data" / "sub" / "my_reward.py").write_text("raise SystemExit('imported!')\n")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "their_reward.py").write_text("def score(sample, completion):\n    return 1.0\n")
    os.symlink(tmp_path / "elsewhere" / "their_reward.py", tmp_path / "data" / "link.py")
    custom = {"kind": "custom", "path": "d.jsonl"}
    spec = check_spec(spec_with(dataset={**custom, "reward_fn": "sub/my_reward.py:score"}), rules(tmp_path), [],
                      tmp_path / "data")
    assert spec.dataset.reward_fn == f"{tmp_path / 'data' / 'sub' / 'my_reward.py'}:score"
    for value, words in (("os:system", "names a module"), ("subprocess:call", "names a module"),
                         ("../elsewhere/their_reward.py:score", "allowed data roots"),
                         ("link.py:score", "allowed data roots"), ("missing.py:score", "not found"),
                         ("sub/my_reward.py", "not of the form"), ("d.jsonl:score", "tenant code is a file"),
                         ("sub/my_reward.txt:score", "not a Python file")):
        with pytest.raises(SpecError) as err:
            check_spec(spec_with(dataset={**custom, "reward_fn": value}), rules(tmp_path), [], tmp_path / "data")
        assert err.value.field == "dataset.reward_fn" and words in str(err.value), (value, str(err.value))
