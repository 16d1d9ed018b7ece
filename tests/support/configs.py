"""Job configs and task specs the tests build: the shipped small configs with changes, and the scheduler tests'
task specs (groups of two)."""
from __future__ import annotations

import yaml

from marlaas_hpc.config import JobConfig
from marlaas_hpc.scheduler import Scheduler, SchedulerConfig
from marlaas_hpc.tasks import TaskSpec
from support.jobs import ROOT

MODEL_OF = {"sort-a": "tiny", "sort-b": "tiny", "gsm8k-hash": "chat", "gsm8k-boxed": "chat"}
"""The base model of each task of configs/multi-model-demo.yaml."""


def small_config(**over) -> dict:
    """configs/test-small.yaml (tasks add and sort; 1 env, 1 rollout, TP=2) with top-level fields replaced."""
    config = yaml.safe_load((ROOT / "configs" / "test-small.yaml").read_text())
    config.update(over)
    return config


def multi_model_demo(tiny_steps: int = 2, chat_steps: int | None = None) -> dict:
    """configs/multi-model-demo.yaml made short: `tiny_steps` steps for each task of the tiny model, `chat_steps`
    (default: the same) for chat-mini's, each of 4 prompts, 8 eval prompts."""
    config = yaml.safe_load((ROOT / "configs" / "multi-model-demo.yaml").read_text())
    for task in config["tasks"]:
        steps = tiny_steps if MODEL_OF[task["task_id"]] == "tiny" else chat_steps or tiny_steps
        task["total_steps"], task["algo"]["batch_prompts"], task["dataset"]["eval_size"] = steps, 4, 8
    return config


def tool_and_addition_job(steps: int, rollout_ranks: int, **fields) -> dict:
    """A whole local job (tiny model, hf engine, 1 env and 1 trainer rank) of a multi-turn tool task whose episodes
    wait on a slow tool while newer versions land ('lookup', k 1) beside a single-turn one ('add', k 0), each of
    `steps` steps; top-level `fields` added."""
    algo = {"group_size": 4, "batch_prompts": 2, "lr": 0.003, "max_new_tokens": 6}
    return {
        "model": "tiny", "engine": "hf", "mode": "async", "rollout_slots": 6,
        "layout": {"env_ranks": 1, "rollout_ranks": rollout_ranks, "trainer_tp": 1},
        "env_pool": {"mode": "thread", "workers": 8, "step_timeout_s": 20},
        "tasks": [
            {"task_id": "lookup", "tenant": "tools", "total_steps": steps, "max_staleness": 1,
             "dataset": {"kind": "lookup", "eval_size": 8, "tool_latency_s": 0.5}, "lora": {"rank": 8, "alpha": 16},
             "algo": {**algo, "max_turns": 3, "max_episode_tokens": 40}},
            {"task_id": "add", "tenant": "plain", "total_steps": steps, "max_staleness": 0,
             "dataset": {"kind": "addition", "eval_size": 8}, "lora": {"rank": 8, "alpha": 16}, "algo": algo},
        ],
        **fields}


def one_task_job(**fields) -> JobConfig:
    """A JobConfig of one task, 't', with every default, and `fields` (which may replace the tasks)."""
    return JobConfig.from_dict({"tasks": [{"task_id": "t"}], **fields})


def with_changes(data: dict, changes: dict) -> dict:
    """`data` (a loaded config) with each `changes` value set at its dotted key ("layout.trainer_tp")."""
    for dotted, value in changes.items():
        *parents, last = dotted.split(".")
        node = data
        for key in parents:
            node = node[key]
        node[last] = value
    return data


def task_spec(task_id: str, k: int = 1, steps: int = 3, batch: int = 2, *, priority: int = 0,
              model: str | None = None, tokens: int | None = None, **algo) -> TaskSpec:
    """A scheduler test's task: staleness bound `k`, `steps` steps of `batch` prompts in groups of two; `model` its
    base model, `tokens` its max_new_tokens, `algo` further algo fields."""
    algo = {"batch_prompts": batch, "group_size": 2, **({"max_new_tokens": tokens} if tokens is not None else {}),
            **algo}
    return TaskSpec.from_dict({"task_id": task_id, "max_staleness": k, "total_steps": steps, "priority": priority,
                               **({"base_model": model} if model is not None else {}), "algo": algo})


def pool_scheduler(ranks=(1, 2), slots=2) -> Scheduler:
    """A scheduler of rollout `ranks` with `slots` each, one env rank, its clock stopped at 0."""
    return Scheduler(SchedulerConfig(rollout_ranks=ranks, env_ranks=(9,), rollout_slots=slots), clock=lambda: 0.0)


def run_plan(capsys, *args) -> tuple[int, str, str]:
    """`marlaas plan ARGS` in this process: (exit code, stdout, stderr)."""
    from marlaas_hpc.cli import main as marlaas

    code = marlaas(["plan", *map(str, args)])
    out = capsys.readouterr()
    return code, out.out, out.err
