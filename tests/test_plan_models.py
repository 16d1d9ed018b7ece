"""`marlaas plan` and `check_fits` of a job of several base models (issue #28): a trainer plan per model (its
groups), the rollout rank planned for the model whose engine needs the most of vLLM's share (every model
checked), the sleeping engines' weights in host memory, and `--model NAME=PATH` overriding one model's path."""
from pathlib import Path

import pytest
import yaml

from marlaas_hpc.config import JobConfig
from marlaas_hpc.config_loader import SpecError
from marlaas_hpc.plan.command import check_fits, job_model_dims, job_plan, trainer_inputs
from support.configs import run_plan as plan, with_changes

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "configs" / "qwen3-0.6b-gsm8k.yaml"
MODELS = {"small": "random:qwen3-0.6b", "big": "random:qwen3-8b"}


def two_models(tmp_path, models=None, **changes) -> Path:
    """The shipped GPU config (8 tasks, vllm) serving two base models: a trainer group each (TP=1 and micro-batches
    of 8192 tokens, where Qwen3-8B's trainer rank does not fit an 80 GB H100 and Qwen3-0.6B's does, and both do at
    TP=2), the first four tasks on `small`, the rest on `big`; `changes` as dotted keys."""
    data = yaml.safe_load(SHIPPED.read_text())
    del data["model"]
    data["models"] = dict(models or MODELS)
    data["layout"].update(trainer_tp=1, trainer_groups=2, trainer_group_models=["small", "big"])
    data["trainer"]["micro_batch_tokens"] = 8192
    for i, task in enumerate(data["tasks"]):
        task["base_model"] = "small" if i < 4 else "big"
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(with_changes(data, changes), sort_keys=False))
    return path


def section(stdout: str, title_start: str) -> str:
    """The lines of the plan whose title starts with `title_start`, up to the next title."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(title_start))
    end = next((i for i in range(start + 1, len(lines)) if not lines[i].startswith("  ")), len(lines))
    return "\n".join(lines[start:end])


def test_each_model_gets_the_trainer_plan_of_its_groups_and_the_one_that_does_not_fit_is_named(tmp_path, capsys):
    code, stdout, stderr = plan(capsys, two_models(tmp_path))
    assert code == 1, stderr
    small, big = section(stdout, "model small: trainer rank"), section(stdout, "model big: trainer rank")
    assert "x1 (layout.trainer_tp 1, 1 group(s) x 1 DP)" in small and "fits in 79.60 GiB" in small
    assert "DOES NOT FIT" in big and "base weights (bfloat16)" in big
    failures = stderr.strip().splitlines()
    assert len(failures) == 1 and failures[0].startswith("marlaas: "), stderr
    assert "model big (models.big)" in failures[0] and "small" not in failures[0], failures[0]


def test_a_model_fitting_alone_passes(tmp_path, capsys):
    code, stdout, stderr = plan(capsys, two_models(tmp_path, models={"small": "random:qwen3-0.6b",
                                                                     "big": "random:qwen3-0.6b"}))
    assert code == 0, stderr
    assert stdout.count(": trainer rank x1 (layout.trainer_tp 1, 1 group(s) x 1 DP)") == 2


def test_the_rollout_rank_is_planned_for_the_largest_engine_and_the_others_sleep_in_host_memory(tmp_path, capsys):
    code, stdout, _ = plan(capsys, two_models(tmp_path))
    rollout = section(stdout, "rollout rank")
    assert "awake: model big" in rollout and "fits" in rollout
    big_weights = float(next(line for line in rollout.splitlines() if "weights (bfloat16)" in line).split()[-2])
    assert big_weights > 14  # Qwen3-8B in bf16, not Qwen3-0.6B's 1.11 GiB
    assert "sleeping engines (model small): 1.11 GiB of weights in host memory" in stdout  # RAM, not GPU
    assert "not GPU" in stdout


def test_a_rollout_share_without_room_for_the_larger_model_is_refused_naming_it(tmp_path, capsys):
    """16 GiB of an 80 GiB GPU holds Qwen3-0.6B's engine with room for its KV cache, not Qwen3-8B's weights."""
    path = two_models(tmp_path, **{"vllm.gpu_memory_utilization": 0.2, "layout.trainer_tp": 2})
    code, stdout, stderr = plan(capsys, path)
    assert code == 1 and "awake: model big" in section(stdout, "rollout rank")
    assert stderr.strip().splitlines() == [line for line in stderr.strip().splitlines()
                                           if line.startswith("marlaas: vllm.gpu_memory_utilization: model big")]
    job = JobConfig.load(path).validate()
    with pytest.raises(SpecError) as caught:
        check_fits(job)
    assert caught.value.field == "vllm.gpu_memory_utilization" and "model big (models.big)" in str(caught.value)


def test_check_fits_refuses_the_model_that_does_not_fit_naming_the_field_and_the_model(tmp_path):
    job = JobConfig.load(two_models(tmp_path)).validate()
    with pytest.raises(SpecError) as caught:
        check_fits(job, gpus_visible=True)
    assert caught.value.field.startswith(("trainer.", "layout.trainer_tp")), caught.value
    assert "model big (models.big)" in caught.value.reason
    check_fits(job, gpus_visible=False)  # CPU ranks: nothing to check
    fitting = JobConfig.load(two_models(tmp_path, **{"layout.trainer_tp": 2})).validate()
    check_fits(fitting, gpus_visible=True)


def test_share_gpus_limits_each_model_s_trainer_to_what_vllm_leaves(tmp_path):
    path = two_models(tmp_path, **{"layout.share_gpus": True, "layout.rollout_ranks": 2, "layout.trainer_tp": 2})
    job = JobConfig.load(path).validate()
    trainers = [p for p in job_plan(job) if p.kind == "trainer"]
    assert [p.model for p in trainers] == ["small", "big"]
    assert all(p.limit == int(79.6 * 2 ** 30 * (1 - 0.85)) for p in trainers)  # an 80 GB H100 reports 79.6 GiB
    assert [p.fits for p in trainers] == [False, False]


def test_model_name_equals_path_overrides_that_model_only(tmp_path, capsys):
    path = two_models(tmp_path, models={"small": "/nowhere/Qwen3-0.6B", "big": "/nowhere/Qwen3-8B"},
                      **{"layout.trainer_tp": 2})
    code, _, stderr = plan(capsys, path, "--model", "small=random:qwen3-0.6b")
    assert code == 2 and "models.big: '/nowhere/Qwen3-8B' holds no config.json" in stderr, stderr
    code, stdout, stderr = plan(capsys, path, "--model", "small=random:qwen3-0.6b", "--model", "big=random:qwen3-8b")
    assert code == 0, stderr
    assert "model big: random:qwen3-8b: hidden 4096" in stdout and "model small: random:qwen3-0.6b: hidden 1024" in stdout


def test_an_unknown_model_name_or_a_bare_path_for_several_models_is_refused(tmp_path, capsys):
    path = two_models(tmp_path)
    code, _, stderr = plan(capsys, path, "--model", "chat=random:qwen3-0.6b")
    assert code == 2 and "--model: unknown model 'chat'" in stderr and "['big', 'small']" in stderr, stderr
    code, _, stderr = plan(capsys, path, "--model", "random:qwen3-0.6b")
    assert code == 2 and "--model: the job has 2 models" in stderr and "NAME=PATH" in stderr, stderr


def test_a_whole_fused_step_is_sized_by_the_tasks_of_the_group_s_model(tmp_path):
    """trainer.micro_batch_tokens 0: one pass over a fused step of the tasks that group's model trains."""
    job = JobConfig.load(two_models(tmp_path, **{"trainer.micro_batch_tokens": 0})).validate()
    job.tasks[-1].algo.batch_prompts = 64  # a task of `big`; the tasks of `small` keep 16 prompts x 8
    dims = job_model_dims(job)
    width = job.vllm.max_model_len
    assert trainer_inputs(job, dims["small"], model="small").micro_batch_tokens == job.trainer_slots * 16 * 8 * width
    assert trainer_inputs(job, dims["big"], model="big").micro_batch_tokens == job.trainer_slots * 64 * 8 * width


def test_sleeping_weights_over_the_rollout_node_s_memory_are_refused_naming_layout_rollout_mem(tmp_path, capsys):
    """Two rollout ranks on one node, each holding Qwen3-0.6B's 1.11 GiB asleep beside its in-memory adapters: a
    `layout.rollout.mem` 1 GiB under their sum is refused, 1 GiB over it passes (as does the tight one once the
    ranks are on two nodes)."""
    from marlaas_hpc.plan.command import job_model_dims, rollout_host_bytes

    shape = {"layout.trainer_tp": 2, "layout.rollout_ranks": 2}
    job = JobConfig.load(two_models(tmp_path, **shape)).validate()
    per_rank = max(rollout_host_bytes(job, dims) for dims in job_model_dims(job).values()) + int(1.11 * 2**30)
    need_gib = 2 * per_rank / 2**30
    tight = two_models(tmp_path, **shape, **{"layout.rollout.mem": f"{int(need_gib) - 1}G"})
    code, stdout, stderr = plan(capsys, tight)
    assert code == 1
    assert "host RAM per node: in-memory adapters, sleeping engines' weights" in stdout
    assert f"{need_gib:.2f} GiB  DOES NOT FIT in {int(need_gib) - 1}.00 GiB" in stdout, stdout
    assert stderr.startswith("marlaas: layout.rollout.mem: a rollout rank's in-memory adapters"), stderr
    assert "the sleeping engines' weights (model small: 1.11 GiB)" in stderr, stderr
    with pytest.raises(SpecError) as caught:
        check_fits(JobConfig.load(tight).validate(), gpus_visible=True)
    assert caught.value.field == "layout.rollout.mem"
    for changes in ({"layout.rollout.mem": f"{int(need_gib) + 1}G"},
                    {"layout.rollout.mem": f"{(int(need_gib) - 1) * 1024}", "layout.rollout.nodes": 2}):
        roomy = two_models(tmp_path, **shape, **changes)
        assert plan(capsys, roomy)[0] == 0
