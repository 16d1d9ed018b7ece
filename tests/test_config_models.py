"""A job's base models (issue #28, item 1): `models: {name: path}` beside the single `model:`, a task's
`base_model` naming one, intake refusing an unknown one, and a job of several models refused while the runtime
serves one."""
import pytest

from marlaas_hpc.config import JobConfig
from marlaas_hpc.config_loader import SpecError
from marlaas_hpc.service.intake import IntakeRules, check_spec


def job(**fields):
    return JobConfig.from_dict({"tasks": [{"task_id": "t"}], **fields})


def refusal(**fields) -> SpecError:
    with pytest.raises(SpecError) as err:
        job(**fields)
    return err.value


def test_a_named_model_is_the_jobs_model_and_tasks_may_name_it():
    config = job(models={"qwen": "tiny"}, tasks=[{"task_id": "a", "base_model": "qwen"}, {"task_id": "b"}])
    assert config.model == "tiny" and config.model_names() == {"qwen": "tiny"}


def test_a_single_model_job_still_loads_and_its_tasks_may_name_its_path():
    config = job(model="tiny", tasks=[{"task_id": "a", "base_model": "tiny"}])
    assert config.model_names() == {"tiny": "tiny"}


def test_a_task_naming_an_unknown_model_is_refused_naming_its_base_model():
    err = refusal(models={"qwen": "tiny"}, tasks=[{"task_id": "a", "base_model": "llama"}])
    assert err.field == "tasks[0].base_model" and "unknown model 'llama'" in str(err)


def test_several_models_are_refused_until_rollout_ranks_multiplex_engines():
    err = refusal(models={"qwen": "tiny", "chat": "chat-mini"})
    assert err.field == "models" and "a job serves one" in str(err) and "do not multiplex" in str(err)


def test_model_and_models_disagreeing_is_refused():
    assert refusal(model="chat-mini", models={"qwen": "tiny"}).field == "model"
    assert refusal(models={"../x": "tiny"}).field == "models"
    assert refusal(models={"qwen": "random:nope"}).field == "models.qwen"


def test_intake_takes_a_spec_naming_the_jobs_model_and_refuses_another(tmp_path):
    rules = IntakeRules.from_job(job(models={"qwen": "tiny"}), tmp_path)
    spec = {"task_id": "n", "tenant": "alice", "dataset": {"kind": "addition"}}
    assert check_spec({**spec, "base_model": "qwen"}, rules, [], tmp_path).base_model == "qwen"
    assert check_spec(spec, rules, [], tmp_path).base_model is None
    with pytest.raises(SpecError) as err:
        check_spec({**spec, "base_model": "llama"}, rules, [], tmp_path)
    assert err.value.field == "base_model" and "unknown model 'llama'" in str(err.value)
