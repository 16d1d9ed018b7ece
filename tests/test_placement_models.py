"""Trainer groups own a base model (issue #28, item 3): placement puts a task only on a group of its
`base_model` (least loaded among them), moves stay inside the model's groups, the layout names each group's
model (`layout.trainer_group_models`, validated with the field named), and intake refuses a task whose model
no group loads, naming `base_model`."""
from functools import partial

import pytest

from marlaas_hpc.config import JobConfig
from marlaas_hpc.config_loader import SpecError
from marlaas_hpc.scheduler import Admit, Move, Placement, Scheduler, SchedulerConfig, Submit
from marlaas_hpc.service.intake import IntakeRules, check_spec
from support.checks import assert_bound_and_progress
from support.configs import task_spec
from support.simloop import SimLoop
from support.workloads import RandomDurations


def test_placement_puts_a_task_only_on_a_group_of_its_model():
    placement = Placement(3, ("tiny", "chat", "tiny"))
    assert placement.place("c1", 10, "chat") == 1
    assert placement.place("c2", 10, "chat") == 1  # group 0 and 2 are emptier, but load tiny
    assert placement.place("t1", 1000, "tiny") == 0
    assert placement.place("t2", 10, "tiny") == 2
    assert placement.place("t3", 10, "tiny") == 2  # 10 < 1000: least loaded among tiny's groups
    assert placement.load == [1000, 20, 20]


def test_moves_stay_among_the_groups_of_the_tasks_model():
    placement = Placement(3, ("tiny", "chat", "tiny"))
    assert [placement.place(t, 1000, "tiny") for t in ("t1", "t2")] == [0, 2]
    assert placement.place("t3", 600, "tiny") == 0  # a tie between tiny's groups: the lowest index
    placement.place("c1", 100, "chat")
    # group 1 (chat) is by far the least loaded, but no tiny task may go there
    assert all(placement.move_target(t) in (None, 0, 2) for t in ("t1", "t2", "t3"))
    assert placement.move_target("c1") is None  # chat has one group


def test_a_model_without_a_group_is_refused_naming_base_model():
    placement = Placement(2, ("tiny", "tiny"))
    with pytest.raises(ValueError, match="base_model: no trainer group loads model 'chat'"):
        placement.place("c", 10, "chat")
    assert Placement(2).place("any", 10, "chat") == 0  # no models named: any group
    with pytest.raises(ValueError, match="trainer_group_models"):
        Placement(2, ("tiny",))


spec = partial(task_spec, tokens=8)  # a task of `model`: 2 prompts a step


class ModelLoop(SimLoop):
    """Checks every Admit and Move keeps the task on a group of its model."""

    groups_model: tuple[str, ...] = ()

    def _execute(self, command):
        tasks = self.scheduler.tasks
        if isinstance(command, Admit):
            assert self.groups_model[command.trainer_group] == command.spec.base_model
        elif isinstance(command, Move):
            assert self.groups_model[command.to_group] == tasks[command.task_id].spec.base_model
        super()._execute(command)


@pytest.mark.parametrize("seed", range(3))
def test_a_scheduled_job_trains_every_task_on_a_group_of_its_model(seed):
    models = ("tiny", "chat", "tiny", "chat")
    loop = ModelLoop.__new__(ModelLoop)
    loop.groups_model = models
    config = SchedulerConfig(rollout_ranks=(1, 2), env_ranks=(99,), rollout_slots=3, max_adapters=8,
                             trainer_slots=2, trainer_groups=4, trainer_group_models=models)
    scheduler = Scheduler(config, clock=lambda: loop.now)
    ModelLoop.__init__(loop, scheduler, RandomDurations(seed), delivery_jitter=0.5, seed=seed)
    specs = [spec(f"t{i}", model=models[i % 2], steps=2 + i % 3) for i in range(8)]
    for s in specs:
        loop.submit(s)
    result = loop.run()
    assert_bound_and_progress(scheduler, result, specs)
    for task in scheduler.tasks.values():
        assert models[task.trainer_group] == task.spec.base_model


def test_layout_names_each_groups_model_with_the_field_named():
    def refusal(**layout):
        with pytest.raises(SpecError) as err:
            JobConfig.from_dict({"models": {"qwen": "tiny"}, "layout": layout, "tasks": [{"task_id": "t"}]})
        return err.value

    assert refusal(trainer_groups=2, trainer_group_models=["qwen"]).field == "layout.trainer_group_models"
    err = refusal(trainer_groups=2, trainer_group_models=["qwen", "llama"])
    assert err.field == "layout.trainer_group_models[1]" and "unknown model 'llama'" in str(err)
    job = JobConfig.from_dict({"models": {"qwen": "tiny"}, "tasks": [{"task_id": "t"}],
                               "layout": {"trainer_groups": 2, "trainer_group_models": ["qwen", "qwen"]}})
    assert job.group_models() == ["qwen", "qwen"]
    assert job.scheduler_config((1,), (2,)).trainer_group_models == ("qwen", "qwen")
    assert JobConfig.from_dict({"layout": {"trainer_groups": 2}}).group_models() == ["tiny", "tiny"]


def test_intake_refuses_a_task_whose_model_no_trainer_group_loads(tmp_path):
    rules = IntakeRules(model="tiny", models={"tiny": "tiny", "chat": "chat-mini"}, max_lora_rank=16,
                        data_roots=[], trainer_group_models=["tiny", "tiny"], run_dir=str(tmp_path))
    data = {"task_id": "n", "tenant": "alice", "dataset": {"kind": "addition"}}
    assert check_spec({**data, "base_model": "tiny"}, rules, [], tmp_path).base_model == "tiny"
    with pytest.raises(SpecError) as err:
        check_spec({**data, "base_model": "chat"}, rules, [], tmp_path)
    assert err.value.field == "base_model" and "no trainer group loads model 'chat'" in str(err.value)
