"""JobLayout validation, YAML mapping and the pure role assignment."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from marlaas_hpc.launch.layout import (COMPONENTS, ComponentResources, JobLayout, LayoutError, assign_role,
                                       parse_slurm_time, ranks_of, require_world_size, trainer_group_ranks,
                                       world_size_matches)

GOLDEN = Path(__file__).parent / "golden"


def test_assign_role_orders_control_env_rollout_trainer():
    layout = JobLayout(env_ranks=2, rollout_ranks=3, trainer_tp=2, trainer_dp=2).validate()
    roles = [assign_role(r, layout) for r in range(layout.world_size)]
    assert layout.world_size == 1 + 2 + 3 + 4
    assert [(r.kind, r.index) for r in roles] == [
        ("scheduler", 0), ("env", 0), ("env", 1), ("rollout", 0), ("rollout", 1), ("rollout", 2),
        ("trainer", 0), ("trainer", 1), ("trainer", 2), ("trainer", 3)]
    assert [r.component for r in roles] == [0, 1, 1, 2, 2, 2, 3, 3, 3, 3]
    # TP groups are consecutive ranks (one node under block distribution)
    assert [(r.tp_rank, r.dp_rank) for r in roles[6:]] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert all(r.tp_rank is None and r.dp_rank is None for r in roles[:6])
    assert list(ranks_of("rollout", layout)) == [3, 4, 5]
    assert list(ranks_of("scheduler", layout)) == [0]


def test_trainer_groups_are_consecutive_blocks_of_dp_times_tp_ranks():
    layout = JobLayout(env_ranks=1, rollout_ranks=1, trainer_tp=2, trainer_dp=2, trainer_groups=3).validate()
    assert layout.trainer_ranks == 12 and layout.world_size == 15 and layout.component_sizes[3] == 12
    groups = trainer_group_ranks(layout)
    assert groups == [[3, 4, 5, 6], [7, 8, 9, 10], [11, 12, 13, 14]]
    for g, ranks in enumerate(groups):
        roles = [assign_role(r, layout) for r in ranks]
        assert {r.group for r in roles} == {g}
        # position j is the same (tp, dp) in every group: a task's state moves position to position
        assert [(r.tp_rank, r.dp_rank) for r in roles] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert assign_role(0, layout).group is None
    assert trainer_group_ranks(JobLayout()) == [[3]]


@pytest.mark.parametrize("rank", [-1, 4, "0", None])
def test_assign_role_refuses_ranks_outside_the_world(rank):
    with pytest.raises(ValueError, match="outside the world of 4"):
        assign_role(rank, JobLayout())


@settings(max_examples=60, deadline=None)
@given(env=st.integers(1, 9), rollout=st.integers(1, 9), tp=st.integers(1, 8), dp=st.integers(1, 4),
       groups=st.integers(1, 3))
def test_roles_partition_the_world(env, rollout, tp, dp, groups):
    layout = JobLayout(env_ranks=env, rollout_ranks=rollout, trainer_tp=tp, trainer_dp=dp,
                       trainer_groups=groups).validate()
    roles = [assign_role(r, layout) for r in range(layout.world_size)]
    for kind, want in zip(("scheduler", "env", "rollout", "trainer"), layout.component_sizes):
        indices = [r.index for r in roles if r.kind == kind]
        assert indices == list(range(want))
        assert [assign_role(r, layout).kind for r in ranks_of(kind, layout)] == [kind] * want
    grid = [(r.group, r.tp_rank, r.dp_rank) for r in roles if r.kind == "trainer"]
    assert sorted(grid) == sorted((g, t, d) for g in range(groups) for t in range(tp) for d in range(dp))
    assert [r.component for r in roles] == sorted(r.component for r in roles)


@pytest.mark.parametrize("changes, field, words", [
    ({"rollout_ranks": 0}, "rollout_ranks", "at least one rollout rank"),
    ({"env_ranks": 0}, "env_ranks", "at least one env rank"),
    ({"trainer_tp": 0}, "trainer_tp", ">= 1"),
    ({"env": ComponentResources(ntasks=0)}, "env.ntasks", "at least one task"),
    ({"trainer": ComponentResources(ntasks=0)}, "trainer.ntasks", "at least one task"),
    ({"trainer_tp": 4, "trainer": ComponentResources(ntasks=6)}, "trainer.ntasks", "not a multiple of trainer_tp=4"),
    ({"trainer_tp": 2, "trainer": ComponentResources(ntasks=4)}, "trainer.ntasks", "must be 2"),
    ({"trainer_groups": 0}, "trainer_groups", ">= 1"),
    ({"trainer_tp": 2, "trainer_groups": 2, "trainer": ComponentResources(ntasks=2)}, "trainer.ntasks",
     "must be 4 .trainer_groups . trainer_dp . trainer_tp = 2 . 1 . 2"),
    ({"control": ComponentResources(ntasks=2)}, "control.ntasks", "scheduler"),
    ({"env_ranks": 3, "env": ComponentResources(ntasks=2)}, "env.ntasks", "env_ranks=3"),
    ({"control": ComponentResources(gpus_per_task=1)}, "control.gpus_per_task", "CPU-only"),
    ({"env": ComponentResources(gpus_per_task=1)}, "env.gpus_per_task", "CPU-only"),
    ({"env": ComponentResources(extra_sbatch=["--gres=gpu:1"])}, "env.extra_sbatch", "CPU-only"),
    ({"env": ComponentResources(extra_sbatch=["--gpus=2"])}, "env.extra_sbatch", "CPU-only"),
    ({"env": ComponentResources(extra_sbatch=["-x n1"])}, "env.extra_sbatch[0]", "long sbatch option"),
    ({"env": ComponentResources(extra_sbatch=["--output=x"])}, "env.extra_sbatch[0]", "launcher"),
    ({"env": ComponentResources(nodes=2)}, "env.nodes", "node would stay empty"),
    ({"env": ComponentResources(nodes=0)}, "env.nodes", ">= 1"),
    ({"trainer_tp": 4, "trainer_dp": 2, "trainer": ComponentResources(nodes=4)}, "trainer.nodes",
     "split a TP group"),
    ({"rollout": ComponentResources(mem="lots")}, "rollout.mem", "not a size"),
    ({"rollout": ComponentResources(time="soon")}, "rollout.time", "not a Slurm time"),
    ({"rollout": ComponentResources(partition="gpu a")}, "rollout.partition", "without spaces"),
    ({"time": 0}, "time", "> 0"),
    ({"mpi": "openmpi"}, "mpi", "pmix"),
    ({"signal_lead_s": -1}, "signal_lead_s", ">= 0"),
    ({"emulated_nodes": True, "network_interface": "ib0"}, "network_interface", "lo"),
    ({"exports": {"1BAD": "x"}}, "exports.1BAD", "environment variable"),
    ({"setup": ["a\nb"]}, "setup[0]", "one shell line"),
    ({"trainer_ep": 2}, "trainer_ep", "must divide trainer_dp=1"),
    ({"trainer_ep": 2, "trainer_dp": 2, "trainer_tp": 2}, "trainer_ep", "trainer_tp 1 only"),
])
def test_validate_names_the_bad_field(changes, field, words):
    with pytest.raises(LayoutError, match=words) as info:
        JobLayout(**changes).validate()
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}: ")


def test_gpu_layout_with_tp_groups_inside_nodes_is_valid():
    layout = JobLayout(trainer_tp=4, trainer_dp=2, trainer=ComponentResources(nodes=2, gpus_per_task=1),
                       rollout_ranks=4, rollout=ComponentResources(nodes=4, gpus_per_task=1)).validate()
    assert layout.component_sizes == (1, 1, 4, 8)


def test_from_dict_maps_yaml_one_to_one_and_round_trips():
    data = yaml.safe_load((GOLDEN / "layout_gpu_tp4.yaml").read_text())
    layout = JobLayout.from_dict(data)
    assert layout.trainer.extra_sbatch == ["--exclusive"] and layout.rollout.nodes == 4
    assert layout.component_sizes == (1, 8, 4, 8)
    assert JobLayout.from_dict(layout.to_dict()) == layout
    assert JobLayout.from_dict(None) == JobLayout()


@pytest.mark.parametrize("data, field, words", [
    ({"rollout_rank": 2}, "rollout_rank", "unknown field"),
    ({"trainer": {"gpus_per_tsk": 1}}, "trainer.gpus_per_tsk", "unknown field"),
    ({"trainer": 4}, "trainer", "must be a mapping"),
    ({"env_ranks": "2"}, "env_ranks", "expected an integer"),
    ({"env_ranks": True}, "env_ranks", "expected an integer"),
    ({"mpi": "pmi3"}, "mpi", "expected"),
    ({"rollout": {"extra_sbatch": "--exclusive"}}, "rollout.extra_sbatch", "expected a list"),
    ({"exports": {"A": 1}}, "exports", "expected a mapping"),
    ({"rollout": {"gpus_per_task": 1.5}}, "rollout.gpus_per_task", "expected an integer"),
])
def test_from_dict_rejects_unknown_and_mistyped_fields(data, field, words):
    with pytest.raises(LayoutError, match=words) as info:
        JobLayout.from_dict(data)
    assert info.value.field == field


def test_every_field_has_a_docstring():
    import ast
    import inspect

    import marlaas_hpc.launch.layout as module

    tree = ast.parse(inspect.getsource(module))
    for cls in (JobLayout, ComponentResources):
        node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls.__name__)
        documented = {stmt.target.id for stmt, nxt in zip(node.body, node.body[1:])
                      if isinstance(stmt, ast.AnnAssign) and isinstance(nxt, ast.Expr)
                      and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)}
        assert {f.name for f in dataclasses.fields(cls)} <= documented, cls.__name__


def test_world_size_check_explains_singletons():
    layout = JobLayout(env_ranks=2, rollout_ranks=1, trainer_tp=2)
    assert world_size_matches(layout, 6)
    check = world_size_matches(layout, 1)
    assert not check and "singleton" in check.message and "needs 6" in check.message
    assert "1 control + 2 env + 1 rollout + 2 trainer" in check.message
    other = world_size_matches(layout, 4)
    assert not other and "singleton" not in other.message and "has 4 rank(s)" in other.message
    with pytest.raises(RuntimeError, match="needs 6"):
        require_world_size(layout, 1)


@pytest.mark.parametrize("text, seconds", [
    (90, 5400), ("90", 5400), ("5:30", 330), ("01:00:00", 3600), ("1-0", 86400), ("2-03", 183600),
    ("1-02:03", 93780), ("1-00:00:10", 86410)])
def test_parse_slurm_time(text, seconds):
    assert parse_slurm_time(text) == seconds


@pytest.mark.parametrize("text", ["", "1h", "1:2:3:4", "-5", 0, "0:00"])
def test_parse_slurm_time_rejects(text):
    with pytest.raises(ValueError):
        parse_slurm_time(text)


def test_components_order_is_the_design_order():
    assert COMPONENTS == ("control", "env", "rollout", "trainer")


def test_join_weights_is_disk_by_default_and_validated():
    assert JobLayout().join_weights == "disk" and JobLayout(join_weights="peer").validate().join_weights == "peer"
    with pytest.raises(LayoutError, match="must be one of \\['peer', 'disk'\\]") as info:
        JobLayout(join_weights="nfs").validate()
    assert info.value.field == "join_weights"
