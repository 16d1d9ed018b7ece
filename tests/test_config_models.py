"""A job's base models (issue #28, item 1): `models: {name: path}` beside the single `model:`, a task's
`base_model` naming one, intake refusing an unknown one, and a job of several models taken once a trainer group
loads each task's model."""
import pytest

from marlaas_hpc.config_loader import SpecError
from marlaas_hpc.service.intake import IntakeRules, check_spec
from support.configs import one_task_job as job


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


def test_several_models_load_once_each_task_has_a_trainer_group_of_its_model():
    two = {"qwen": "tiny", "chat": "chat-mini"}
    tasks = [{"task_id": "a"}, {"task_id": "b", "base_model": "chat"}]
    err = refusal(models=two, tasks=tasks)  # every group loads the first model by default
    assert err.field == "tasks[1].base_model" and "no trainer group loads model 'chat'" in str(err)
    config = job(models=two, tasks=tasks, layout={"trainer_groups": 2, "trainer_group_models": ["qwen", "chat"]})
    assert config.model == "tiny" and config.group_models() == ["qwen", "chat"]


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


def test_several_models_on_gpu_vllm_rollout_ranks_run_each_engine_in_its_own_process():
    layout = {"trainer_groups": 2, "trainer_group_models": ["qwen", "chat"]}
    two = {"qwen": "tiny", "chat": "chat-mini"}
    config = job(models=two, engine="vllm", layout=layout)
    config.check_models(vllm_on_cpu=True)  # the CPU twin: each engine sleeps by hand (rollout/engine_set.py)
    config.check_models(vllm_on_cpu=False)  # 'auto': each engine's core in a process of its own
    assert config.vllm.own_process(2, on_gpu=True) and not config.vllm.own_process(2, on_gpu=False)
    assert not config.vllm.own_process(1, on_gpu=True), "one model: in process, the quicker start"
    in_process = job(models=two, engine="vllm", layout=layout, vllm={"engine_process": "in_process"})
    in_process.check_models(vllm_on_cpu=True)
    with pytest.raises(SpecError) as err:
        in_process.check_models(vllm_on_cpu=False)
    assert err.value.field == "vllm.engine_process" and "process of its own" in str(err.value)
    assert refusal(vllm={"engine_process": "spawn"}).field == "vllm.engine_process"


def test_relays_with_several_models_are_refused_naming_delta_transport():
    two = {"qwen": "tiny", "chat": "chat-mini"}
    err = refusal(models=two, delta={"transport": "relay"}, fault={"on_rank_loss": "stop"},
                  layout={"trainer_groups": 2, "trainer_group_models": ["qwen", "chat"]},
                  tasks=[{"task_id": "a"}, {"task_id": "b", "base_model": "chat"}])
    assert err.field == "delta.transport" and "one base model" in str(err)


def test_peer_fed_joins_with_several_models_are_refused_naming_join_weights():
    two = {"qwen": "tiny", "chat": "chat-mini"}
    err = refusal(models=two, layout={"trainer_groups": 2, "trainer_group_models": ["qwen", "chat"],
                                      "join_weights": "peer"},
                  tasks=[{"task_id": "a"}, {"task_id": "b", "base_model": "chat"}])
    assert err.field == "layout.join_weights" and "several" in str(err)
