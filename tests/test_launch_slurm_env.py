"""Placement from Slurm environments recorded on the local cluster (slurm/local-cluster/record_env.py)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from submitit.slurm.slurm import _parse_node_list

from marlaas_hpc.launch.layout import JobLayout, assign_role
from marlaas_hpc.launch.slurm_env import SlurmEnvError, expand_hostlist, in_slurm_step, placement_from_env

RECORDED = Path(__file__).parent / "golden" / "slurm_env"


def _recorded(name: str) -> list[dict[str, str]]:
    return json.loads((RECORDED / name).read_text())


@pytest.mark.parametrize("hostlist, hosts", [
    ("c1", ["c1"]),
    ("c[1-2],g1", ["c1", "c2", "g1"]),
    ("c[1-2],g[1-3]", ["c1", "c2", "g1", "g2", "g3"]),
    ("n[001-003,5]", ["n001", "n002", "n003", "n5"]),
    ("n[08-11]", ["n08", "n09", "n10", "n11"]),
    ("gpu[1-2]-ib", ["gpu1-ib", "gpu2-ib"]),
    ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
    ("a1, b[3,1]", ["a1", "b3", "b1"]),
    ("node-7.cluster", ["node-7.cluster"]),
])
def test_expand_hostlist(hostlist, hosts):
    assert expand_hostlist(hostlist) == hosts


@pytest.mark.parametrize("bad", ["", "n[1-3", "n1-3]", "n[a-b]", "n[3-1]", "n[[1]]"])
def test_expand_hostlist_rejects_malformed(bad):
    with pytest.raises(SlurmEnvError):
        expand_hostlist(bad)


_prefix = st.text("abcxyz-", min_size=1, max_size=4).filter(lambda s: s[0] != "-")
_range = st.tuples(st.integers(0, 30), st.integers(0, 5), st.integers(1, 3)).map(
    lambda t: f"{t[0]:0{t[2]}d}" + (f"-{t[0] + t[1]:0{t[2]}d}" if t[1] else ""))


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(_prefix, st.lists(_range, min_size=1, max_size=3)), min_size=1, max_size=4))
def test_expand_hostlist_agrees_with_submitits_parser(groups):
    hostlist = ",".join(f"{p}[{','.join(rs)}]" for p, rs in groups)
    assert expand_hostlist(hostlist) == _parse_node_list(hostlist)


def test_recorded_het_step_places_every_rank_in_its_layout_component():
    envs = _recorded("het_1_1_2_2.json")
    layout = JobLayout(env_ranks=1, rollout_ranks=2, trainer_tp=2)
    assert len(envs) == layout.world_size
    for rank, env in enumerate(envs):
        placement = placement_from_env(env)
        role = assign_role(placement.rank, layout)
        assert placement.rank == rank and placement.world_size == 6
        assert placement.component == role.component and placement.component_rank == role.index
        assert placement.component_sizes == (1, 1, 2, 2) and placement.is_het
        assert placement.mismatch_with(layout) is None
        assert placement.rendezvous_host == "c1"            # first host of the step: runs rank 0
        assert placement.component_host(3) == "g2"          # trainer-only groups rendezvous there
        assert placement.job_id == envs[0]["SLURM_JOB_ID"]  # the leader's id in every component
        assert placement.node_name == placement.component_nodes[placement.component][0]
    assert [placement_from_env(e).local_rank for e in envs] == [0, 0, 0, 1, 0, 1]


def test_recorded_het_step_with_a_component_on_two_nodes():
    envs = _recorded("het_1_1_2_2_rollout_2_nodes.json")
    placements = [placement_from_env(e) for e in envs]
    assert placements[0].component_nodes == (("c1",), ("c2",), ("g1", "g2"), ("g3",))
    assert placements[0].step_nodes == ("c1", "c2", "g1", "g2", "g3")
    assert [p.node_name for p in placements] == ["c1", "c2", "g1", "g2", "g3", "g3"]
    assert [p.component for p in placements] == [0, 1, 2, 2, 3, 3]


def test_layout_mismatch_is_explained():
    env = _recorded("het_1_1_2_2.json")[3]
    placement = placement_from_env(env)
    assert "differ from the layout" in placement.mismatch_with(JobLayout(env_ranks=2, rollout_ranks=1, trainer_tp=2))
    message = placement.mismatch_with(JobLayout(env_ranks=1, rollout_ranks=2, trainer_tp=1))
    assert message == ("Slurm het-group task counts (1, 1, 2, 2) differ from the layout "
                       "(control=1, env=1, rollout=2, trainer=1)")


def test_recorded_plain_step_is_one_component():
    envs = _recorded("plain_3_tasks_2_nodes.json")
    placements = [placement_from_env(e) for e in envs]
    assert [p.rank for p in placements] == [0, 1, 2]
    assert all(p.component == 0 and p.component_sizes == (3,) and not p.is_het for p in placements)
    assert placements[0].rendezvous_host == "c1"
    assert placements[0].mismatch_with(JobLayout()) == "Slurm step has 3 tasks but the layout needs 4"


def test_restart_count_and_missing_variables():
    env = dict(_recorded("het_1_1_2_2.json")[0], SLURM_RESTART_COUNT="1")
    assert placement_from_env(env).restart_count == 1
    with pytest.raises(SlurmEnvError, match="SLURM_PROCID is not set"):
        placement_from_env({})
    broken = dict(env, SLURM_NTASKS_HET_GROUP_3="5")
    with pytest.raises(SlurmEnvError, match="het-group task counts"):
        placement_from_env(broken)
    with pytest.raises(SlurmEnvError, match="not an integer"):
        placement_from_env(dict(env, SLURM_PROCID="x"))


def test_in_slurm_step_tells_srun_tasks_from_other_processes():
    env = _recorded("het_1_1_2_2.json")[0]
    assert in_slurm_step(env)
    batch_script = {k: v for k, v in env.items() if not k.startswith("SLURM_STEP") and k != "SLURM_PROCID"}
    assert not in_slurm_step(batch_script) and not in_slurm_step({})


@pytest.mark.parametrize("environ, expected", [
    ({}, "HOME_CACHE"),  # local mode: the project's cache (the home directory is this machine's)
    ({"SLURM_JOB_ID": "7"}, "/tmp/marlaas_hpc-UID/compile"),
    ({"SLURM_JOB_ID": "7", "TMPDIR": "/local/job7"}, "/local/job7/marlaas_hpc-UID/compile"),
    ({"SLURM_JOB_ID": "7", "TMPDIR": "/local/job7", "SLURM_TMPDIR": "/scratch/7"}, "/scratch/7/marlaas_hpc-UID/compile"),
    ({"SLURM_JOB_ID": "7", "TMPDIR": ""}, "/tmp/marlaas_hpc-UID/compile"),
    ({"SLURM_JOB_ID": "7", "TMPDIR": "/local", "MARLAAS_COMPILE_CACHE": "/nfs/shared"}, "/nfs/shared"),
    ({"MARLAAS_COMPILE_CACHE": "/elsewhere"}, "/elsewhere"),
])
def test_compile_caches_go_to_node_local_storage_under_slurm(environ, expected):
    """Under the home directory (NFS on clusters) every rank of every node shared one compile cache."""
    import os

    from marlaas_hpc.launch.slurm_env import compile_cache_dir

    home_cache = Path("/home/u/.cache/marlaas_hpc/vllm")
    expected = str(home_cache) if expected == "HOME_CACHE" else expected.replace("UID", str(os.getuid()))
    assert compile_cache_dir(environ, home_cache) == Path(expected)


def test_the_vllm_engine_puts_every_compile_cache_under_its_cache_dir(tmp_path, monkeypatch):
    from marlaas_hpc.rollout.vllm_engine import _set_vllm_env

    for name in ("VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "VLLM_ENABLE_V1_MULTIPROCESSING"):
        monkeypatch.delenv(name, raising=False)
    _set_vllm_env(tmp_path)
    import os

    assert {name: os.environ[name] for name in ("VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")} \
        == {"VLLM_CACHE_ROOT": str(tmp_path / "vllm_cache"), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor_cache"),
            "TRITON_CACHE_DIR": str(tmp_path / "triton_cache")}
