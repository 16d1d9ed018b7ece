"""Which base model each task fine-tunes, in the job's outputs (issue #28, Must show): summary.json and
status.json give each task's `base_model` (rank 0 names a task's model as the job names it: None is the
first), `marlaas status` and the report's task table show it, and the report's Gantt chart colours rollout
rows by model when the job served several."""
import json
import shutil
from pathlib import Path

from marlaas_hpc.cli import main as marlaas
from marlaas_hpc.config import JobConfig
from marlaas_hpc.report import load_run
from marlaas_hpc.report.plots import model_colours, span_keys, task_models, utilisation_gantt
from marlaas_hpc.runtime.outputs import write_summary
from marlaas_hpc.scheduler import Scheduler, SchedulerConfig, Submit
from marlaas_hpc.tasks import TaskSpec
from marlaas_hpc.tasks.spec import with_base_model

FIXTURES = Path(__file__).parent / "fixtures" / "report"


def test_summary_gives_each_tasks_base_model_and_the_jobs_models(tmp_path):
    job = JobConfig.from_dict({"tasks": [{"task_id": "t"}]})
    scheduler = Scheduler(SchedulerConfig(rollout_ranks=(1,), env_ranks=(2,)), clock=lambda: 0.0)
    for spec in (TaskSpec(task_id="a"), TaskSpec(task_id="b", base_model="tiny")):
        scheduler.handle(Submit(with_base_model(spec, job.model_names())))
    summary = write_summary(tmp_path, job, scheduler, {}, [], 1.0, {})
    written = json.loads((tmp_path / "summary.json").read_text())
    assert written == json.loads(json.dumps(summary))
    assert {t: info["base_model"] for t, info in written["tasks"].items()} == {"a": "tiny", "b": "tiny"}
    assert written["models"] == {"tiny": "tiny"}


def two_model_run(tmp_path) -> Path:
    """The async fixture run with its two tasks on two base models."""
    run = tmp_path / "run"
    shutil.copytree(FIXTURES / "async", run)
    summary = json.loads((run / "summary.json").read_text())
    summary["tasks"]["t0"]["base_model"] = "tiny"
    summary["tasks"]["t1"]["base_model"] = "/models/chat-mini"
    (run / "summary.json").write_text(json.dumps(summary))
    return run


def test_status_names_each_tasks_model(tmp_path, capsys):
    run = two_model_run(tmp_path)
    assert marlaas(["status", str(run)]) == 0
    lines = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()[1:]}
    assert lines["task"][2] == "model"
    assert lines["t0"][2] == "tiny" and lines["t1"][2] == "chat-mini"


def test_status_of_a_run_dir_from_before_models_were_named(capsys):
    assert marlaas(["status", str(FIXTURES / "async")]) == 0
    lines = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()[1:]}
    assert lines["t0"][2] == "-"


def test_gantt_colours_rollout_rows_by_model_when_there_are_several(tmp_path):
    run = load_run(two_model_run(tmp_path))
    assert task_models(run) == {"t0": "tiny", "t1": "/models/chat-mini"}
    colours = model_colours(run)
    assert set(colours) == {"model tiny", "model /models/chat-mini"}
    model_of = task_models(run)
    rollout = {"role": "rollout", "tasks": ["t0", "t1"]}
    assert span_keys(rollout, model_of, True) == ["model /models/chat-mini", "model tiny"]
    assert span_keys({"role": "trainer", "tasks": ["t0"]}, model_of, True) == ["t0"]
    assert span_keys(rollout, model_of, False) == ["t0", "t1"]
    assert model_colours(load_run(FIXTURES / "async")) == {}  # one model (none named): coloured by task
    assert utilisation_gantt(run, tmp_path).is_file()


def test_report_task_table_names_the_model(tmp_path):
    assert marlaas(["report", str(two_model_run(tmp_path)), "-o", str(tmp_path / "out")]) == 0
    lines = (tmp_path / "out" / "report.md").read_text().splitlines()
    rows = [line for line in lines if line.startswith(("| t0 ", "| t1 "))]
    assert rows[0].split("|")[3].strip() == "tiny" and rows[1].split("|")[3].strip() == "/models/chat-mini"
