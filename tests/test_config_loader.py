"""The one config loader (marlaas_hpc/config_loader.py): every YAML-backed config refuses bad input with one error
type that names the dotted field; the shipped YAML files load; modes and orders are written once."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest

from marlaas_hpc.config import JobConfig
from marlaas_hpc.config_loader import SpecError, join, load_config
from marlaas_hpc.launch.layout import JobLayout, LayoutError
from marlaas_hpc.service.intake import IntakeRules
from marlaas_hpc.sim.workload import load_workload, workload_from_dict
from marlaas_hpc.tasks.spec import TaskSpec

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------ the loader itself
def _metres(value, name):
    if not (isinstance(value, str) and value.endswith(" m")):
        raise SpecError(name, f"must be a length like '3 m', got {value!r}")
    return float(value[:-2])


@dataclass(kw_only=True)
class Part:
    size: int = 1

    def validate(self, prefix: str = "part") -> "Part":
        if self.size < 1:
            raise SpecError(f"{prefix}.size", f"must be >= 1, got {self.size}")
        return self


@dataclass(kw_only=True)
class Machine:
    name: str
    ratio: float = 0.5
    pair: tuple[int, int] | None = None
    tags: tuple[str, ...] = ()
    mode: Literal["fast", "slow"] = "fast"
    part: Part = field(default_factory=Part)
    parts: list[Part] = field(default_factory=list)
    spares: dict[str, Part] = field(default_factory=dict)
    length: float = field(default=0.0, metadata={"parse": _metres})
    validated_as: str | None = None

    def validate(self, prefix: str = "") -> "Machine":
        self.validated_as = prefix
        self.part.validate(join(prefix, "part"))
        for i, part in enumerate(self.parts):
            part.validate(join(prefix, f"parts[{i}]"))
        for key, part in self.spares.items():
            part.validate(join(prefix, f"spares.{key}"))
        return self


def test_loader_converts_yaml_forms_and_validates_the_root_at_its_place():
    machine = load_config(Machine, {"name": "m", "ratio": 1, "pair": [2, 3], "tags": ["a", "b"], "part": None,
                                    "parts": [{"size": 2}, {}], "spares": {"x": {"size": 4}}, "length": "3 m"},
                          "machines.m")
    assert machine.ratio == 1.0 and isinstance(machine.ratio, float), "an int is taken as a float"
    assert machine.pair == (2, 3) and machine.tags == ("a", "b"), "YAML lists become tuples"
    assert machine.part == Part(), "a null section means its defaults"
    assert [p.size for p in machine.parts] == [2, 1] and machine.spares["x"].size == 4
    assert machine.length == 3.0, "a field's own parser runs instead of the type check"
    assert machine.validated_as == "machines.m", "the root's validate gets its place in the file"


@pytest.mark.parametrize("data, field_name, words", [
    ({}, "name", "is required"),
    ({"name": "m", "colour": "red"}, "colour", "unknown field"),
    ({"name": 5}, "name", "expected a string"),
    ({"name": "m", "ratio": True}, "ratio", "expected a number"),
    ({"name": "m", "pair": [1, 2, 3]}, "pair", "expected a list of 2"),
    ({"name": "m", "pair": [1, "2"]}, "pair", "expected a list of 2"),
    ({"name": "m", "tags": "a"}, "tags", "expected a list of strings"),
    ({"name": "m", "mode": "warp"}, "mode", "expected one of ['fast', 'slow']"),
    ({"name": "m", "part": 3}, "part", "must be a mapping"),
    ({"name": "m", "part": {"size": 1.5}}, "part.size", "expected an integer"),
    ({"name": "m", "part": {"size": 0}}, "part.size", "must be >= 1"),
    ({"name": "m", "parts": [{}, {"sise": 2}]}, "parts[1].sise", "unknown field"),
    ({"name": "m", "parts": {"size": 2}}, "parts", "expected a list"),
    ({"name": "m", "spares": {"x": {"size": "big"}}}, "spares.x.size", "expected an integer"),
    ({"name": "m", "spares": [1]}, "spares", "expected a mapping"),
    ({"name": "m", "length": 3}, "length", "like '3 m'"),
])
def test_loader_names_the_bad_field(data, field_name, words):
    with pytest.raises(SpecError) as info:
        load_config(Machine, data)
    assert info.value.field == field_name and words in str(info.value), str(info.value)
    assert str(info.value).startswith(f"{field_name}: ")


def test_one_error_type_and_the_caller_picks_a_subclass():
    import marlaas_hpc.tasks
    import marlaas_hpc.tasks.spec

    assert marlaas_hpc.tasks.SpecError is marlaas_hpc.tasks.spec.SpecError is SpecError
    with pytest.raises(LayoutError) as info:
        JobLayout.from_dict({"trainer": {"nodez": 1}})
    assert info.value.field == "trainer.nodez" and isinstance(info.value, SpecError)
    assert info.value.under("layout").field == "layout.trainer.nodez"
    assert type(info.value.under("layout")) is LayoutError


# ------------------------------------------------------------------------------- every YAML-backed config
@pytest.mark.parametrize("data, field_name", [
    ({"mode": "lockstep"}, "mode"),
    ({"order": "lifo"}, "order"),
    ({"max_adapters": 2.5}, "max_adapters"),
    ({"data_roots": [1]}, "data_roots"),
    ({"serve_idle_s": "soon"}, "serve_idle_s"),
    ({"layout": {"trainer": {"gpus_per_tsk": 1}}}, "layout.trainer.gpus_per_tsk"),
    ({"layout": {"env_ranks": "2"}}, "layout.env_ranks"),
    ({"layout": {"env_ranks": 0}}, "layout.env_ranks"),
    ({"layout": {"rollout": {"mem": "lots"}}}, "layout.rollout.mem"),
    ({"vllm": {"dtype": "int8"}}, "vllm.dtype"),
    ({"vllm": {"max_model_len": "long"}}, "vllm.max_model_len"),
    ({"trainer": {"dtype": "fp8"}}, "trainer.dtype"),
    ({"trainer": {"micro_batch_tokens": "big"}}, "trainer.micro_batch_tokens"),
    ({"checkpoint": {"every_minutes": "often"}}, "checkpoint.every_minutes"),
    ({"checkpoint": {"every_steps": -1}}, "checkpoint.every_steps"),
    ({"adapters": {"keep_last": True}}, "adapters.keep_last"),
    ({"env_pool": {"step_timeout_s": 0}}, "env_pool.step_timeout_s"),
    ({"env_pool": {"mode": "fibers"}}, "env_pool.mode"),
    ({"tenant_quotas": {"bob": {"max_tasks": "2"}}}, "tenant_quotas.bob.max_tasks"),
    ({"tenant_quotas": ["bob"]}, "tenant_quotas"),
    ({"tenants": {"lab": {"users": "alice"}}}, "tenants.lab.users"),
    ({"tenants": {"lab": {"users": [""]}}}, "tenants.lab.users"),
    ({"tenants": {"lab": {"owners": ["alice"]}}}, "tenants.lab.owners"),
    ({"sandbox": {"uid_range": [1, 2, 3]}}, "sandbox.uid_range"),
    ({"sandbox": {"reward_timeout_s": 0}}, "sandbox.reward_timeout_s"),
    ({"tasks": {"task_id": "a"}}, "tasks"),
    ({"tasks": [{"lora": {}}]}, "tasks[0].task_id"),
    ({"tasks": [{"task_id": "a"}, {"task_id": "b", "lora": {"rank": 0}}]}, "tasks[1].lora.rank"),
    ({"tasks": [{"task_id": "a", "algo": {"lr": "fast"}}]}, "tasks[0].algo.lr"),
    ({"tasks": [{"task_id": "a", "prompt": {"format": "html"}}]}, "tasks[0].prompt.format"),
    ({"tasks": [{"task_id": "a"}, {"task_id": "a"}]}, "tasks[1].task_id"),
])
def test_job_config_names_the_bad_field(data, field_name):
    with pytest.raises(SpecError) as info:
        JobConfig.from_dict(data)
    assert info.value.field == field_name, str(info.value)
    assert str(info.value).startswith(f"{field_name}: ")


@pytest.mark.parametrize("data, field_name", [
    ({"task_id": "a", "dataset": {"kind": "addition", "eval_size": "all"}}, "dataset.eval_size"),
    ({"task_id": "a", "keep_versions": "1,2"}, "keep_versions"),
    ({"task_id": "a", "lora": {"target_modules": "q_proj"}}, "lora.target_modules"),
    ({"task_id": "a", "prompt": {"template_kwargs": {"enable_thinking": [1]}}}, "prompt.template_kwargs"),
    ({"task_id": "../a"}, "task_id"),
])
def test_task_spec_names_the_bad_field(data, field_name):
    with pytest.raises(SpecError) as info:
        TaskSpec.from_dict(data)
    assert info.value.field == field_name, str(info.value)


@pytest.mark.parametrize("path, value, field_name", [
    ("rollout.max_running_sequences", 0, "rollout.max_running_sequences"),
    ("rollout.batch_exponent", -0.5, "rollout.batch_exponent"),
    ("trainer.tp_exponent", "fast", "trainer.tp_exponent"),
    ("profiles", {}, "profiles"),
    ("evals", "yes", "evals"),
])
def test_workload_names_the_bad_field(path, value, field_name):
    data = {}
    *parents, leaf = path.split(".")
    node = data
    for key in parents:
        node = node.setdefault(key, {})
    node[leaf] = value
    with pytest.raises(SpecError) as info:
        workload_from_dict(data)
    assert info.value.field == field_name, str(info.value)


def test_intake_rules_of_job_json_round_trip_and_refuse_a_bad_field(tmp_path):
    job = JobConfig.from_dict({"tenant_quotas": {"bob": {"max_tasks": 2}}, "tenants": {"lab": {"users": ["al"]}},
                               "sandbox": {"uid_range": [20000, 20100]}})
    rules = IntakeRules.from_job(job, tmp_path)
    rules.save()
    assert IntakeRules.load(tmp_path) == rules
    data = json.loads((tmp_path / "job.json").read_text())
    data["tenant_quotas"]["bob"]["max_tasks"] = "two"
    (tmp_path / "job.json").write_text(json.dumps(data))
    with pytest.raises(SpecError) as info:
        IntakeRules.load(tmp_path)
    assert info.value.field == "tenant_quotas.bob.max_tasks"


def test_every_shipped_yaml_loads():
    configs = sorted((ROOT / "configs").glob("*.yaml"))
    assert len(configs) >= 5
    for path in configs:
        JobConfig.load(path)
    for path in sorted((ROOT / "configs" / "tasks").glob("*.yaml")):
        import yaml

        TaskSpec.from_dict(yaml.safe_load(path.read_text()))
    for path in sorted((ROOT / "configs" / "workloads").glob("*.yaml")):
        load_workload(path)


def test_no_config_module_keeps_a_loader_of_its_own():
    """Only config_loader.py checks mappings against dataclass fields (check_fields) or converts by type hints;
    the simulator's distributions (a field parser) are the one other caller of check_fields."""
    callers = {path.relative_to(ROOT).as_posix() for path in (ROOT / "marlaas_hpc").rglob("*.py")
               if re.search(r"\bcheck_fields\(|get_type_hints\(", path.read_text())}
    assert callers == {"marlaas_hpc/config_loader.py", "marlaas_hpc/sim/workload.py"}, callers


def test_modes_and_orders_are_written_once():
    """The scheduler's modes and orders are spelled in one place each (a tuple, or the keys of one table);
    every other module of the package imports them."""
    from marlaas_hpc.scheduler import MODES, ORDERS

    assert MODES == ("async", "sync", "sequential") and ORDERS == ("fair", "priority", "fifo")
    sources = list((ROOT / "marlaas_hpc").rglob("*.py"))
    for words in (MODES, ORDERS):
        # A list or tuple of the names in order, or a dict with them as its keys in order.
        spelled = re.compile(r"[\[({]\s*" + r"[^,]*,\s*".join(f"[\"']{w}[\"']" for w in words))
        where = [p.relative_to(ROOT).as_posix() for p in sources if spelled.search(p.read_text())]
        assert len(where) == 1, (words, where)


def test_bounds_declared_beside_each_field_are_checked_by_one_validator_with_one_wording():
    """`bounded` puts a field's bounds in its metadata; `check_bounds` refuses a value of the wrong type or out of
    bounds, naming the field, the same way whether the object came from YAML or was built in code."""
    import dataclasses as dc

    from marlaas_hpc.config_loader import bounded, check_bounds

    @dc.dataclass
    class Part:
        count: int = bounded(1, ge=1)
        share: float = bounded(0.5, gt=0, lt=1)
        wait_s: float = bounded(10.0, gt=0, unit="seconds")
        kind: str = bounded("a", choices=("a", "b"))
        on: bool = bounded(True)
        cap: int | None = bounded(None, ge=1)  # None: not set
        switch: bool | None = bounded(None)
        free: int = 7  # no bounds: not checked here

        def validate(self, prefix=""):
            check_bounds(self, prefix)
            return self

    assert load_config(Part, {"count": 3, "share": 0.25, "kind": "b"}).count == 3
    refusals = [({"count": 0}, "part.count: must be an integer >= 1, got 0"),
                ({"count": 2.5}, "part.count: must be an integer >= 1, got 2.5"),
                ({"share": 1}, "part.share: must be a number in (0, 1), got 1"),
                ({"wait_s": 0}, "part.wait_s: must be a number of seconds > 0, got 0"),
                ({"wait_s": float("nan")}, "part.wait_s: must be a finite number of seconds > 0, got nan"),
                ({"wait_s": float("inf")}, "part.wait_s: must be a finite number of seconds > 0, got inf"),
                ({"kind": "c"}, "part.kind: must be one of ['a', 'b'], got 'c'"),
                ({"on": "yes"}, "part.on: must be true or false, got 'yes'"),
                ({"cap": 0}, "part.cap: must be an integer >= 1, got 0"),
                ({"switch": 1}, "part.switch: must be true or false, got 1")]
    for change, message in refusals:
        with pytest.raises(SpecError) as refused:
            dc.replace(Part(), **change).validate("part")
        assert str(refused.value) == message
    assert Part(free=-1).validate() is not None
    assert Part(cap=4, switch=False).validate().cap == 4
