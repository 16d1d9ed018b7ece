"""Relays in a fault-tolerant job (`delta.transport: relay` with the default `fault.on_rank_loss: continue`,
runtime/relay_plane.py; issue #29 follow-up of issue #25), a real `marlaas run` on the ULFM Open MPI local mode:

- the first rollout rank of three, the root of the relay chain (every leader pushes into it; it forwards to the
  next), or the middle one, is SIGKILLed mid-run. The job finishes by itself (exit 0), its groups are issued again, every version of
  every task is trained exactly once, and the tier is re-formed over the two live ranks: both keep installing new
  versions of both tasks from their relays after the loss, each version newer than the last;
- `marlaas scale` 1 -> 2 -> 1 with relays: the joined rank gets a relay with the re-formed tier (the chain over both
  ranks), installs every task's version from it before its first group of that task, generates groups that are
  trained; its drain re-forms the tier over the first rank alone, which goes on installing; the audit is exact;
- `layout.rollout_replace` with relays: the only rollout rank SIGKILLed, so no relay is left (the leader pushes
  nothing meanwhile); its replacement gets the tier of the next epoch and every task's version, and the job ends.
"""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import yaml

from marlaas_hpc.launch.mpi import ulfm_prefix
from support.checks import check_ended_with_its_summary, check_every_version_once
from support.configs import small_config
from support.jobs import FAULT_STEPS as STEPS
from support.jobs import KILL_STEPS
from support.jobs import Job, rank_timelines, scale

pytestmark = [pytest.mark.mpi, pytest.mark.slow,
              pytest.mark.skipif(ulfm_prefix() is None, reason="needs the ULFM Open MPI (tools/setup_env.sh)")]


def _relay_config(tmp_path: Path, rollout_ranks: int, steps: int = STEPS, **layout) -> Path:
    config = small_config(layout={"env_ranks": 1, "rollout_ranks": rollout_ranks, "trainer_tp": 1, **layout},
                          checkpoint={"every_steps": 5, "every_minutes": 0}, delta={"transport": "relay"})
    assert "fault" not in config or config["fault"].get("on_rank_loss", "continue") == "continue"
    for task in config["tasks"]:
        task["total_steps"] = steps
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _rollout_ranks(run_dir: Path) -> list[dict]:
    records = (json.loads(p.read_text()) for p in (run_dir / "ranks").glob("rank*.json"))
    return sorted((r for r in records if r["role"] == "rollout"), key=lambda r: r["rank"])


@pytest.mark.parametrize("place", [0, 1], ids=["root", "middle"])
def test_sigkill_of_a_relay_s_rank_re_forms_the_tier_and_stops_no_task(tmp_path, place):
    """`root`: every push goes through the victim (the leader's sends to it fail, the next relay loses its parent);
    `middle`: the root loses a child it forwards to, the last relay its parent."""
    run_dir = tmp_path / "run"
    job = Job([str(_relay_config(tmp_path, 3, steps=KILL_STEPS)), "--run-dir", str(run_dir)], tmp_path)
    job.wait_steps(4)
    victim = _rollout_ranks(run_dir)[place]
    os.kill(victim["pid"], signal.SIGSTOP)  # held a moment first, so that it holds groups when it dies
    time.sleep(1.0)
    os.kill(victim["pid"], signal.SIGKILL)
    assert job.finish() == 0, job.output()
    check_ended_with_its_summary(run_dir, time.time())
    assert "job stopped" not in job.err and not (run_dir / "crash.json").exists()
    assert "Exception in thread" not in job.err and "Traceback" not in job.err, job.err[-3000:]
    lines = [line for line in job.lines if line.startswith("[fault]")]
    assert len(lines) == 1 and lines[0].startswith(f"[fault] rank {victim['rank']} (rollout) lost"), job.output()
    summary = check_every_version_once(run_dir, KILL_STEPS)  # exact audit: each version trained once, from B groups
    (loss,) = summary["ranks_lost"]
    assert loss["rank"] == victim["rank"] and loss["role"] == "rollout"
    assert sum(t["reissued_groups"] for t in summary["tasks"].values()) == len(loss["groups_reissued"]) > 0
    (group,) = summary["trainer_groups"].values()
    assert group["delta"]["sent"] > 2 * (KILL_STEPS + 1), "every task's newest version was pushed again"
    assert group["delta"]["relay_epoch"] == 1 and group["delta"]["tiers_retired"] == 1, group["delta"]
    timeline = rank_timelines(run_dir)
    survivors = [r["rank"] for r in _rollout_ranks(run_dir) if r["rank"] != victim["rank"]]
    tasks = [task["task_id"] for task in yaml.safe_load((run_dir / "job.yaml").read_text())["tasks"]]
    for rank in survivors:
        reforms = [r for r in timeline[f"rank{rank}"] if r["stage"] == "relay_reform"]
        assert [(r["epoch"], r["relays"]) for r in reforms] == [(1, survivors)], reforms  # the chain over the live
        for task_id in tasks:
            installed = [(r["start"], r["version"]) for r in timeline[f"rank{rank}"]
                         if r["stage"] == "load_delta" and r["tasks"] == [task_id]]
            versions = [v for _, v in installed]
            assert versions == sorted(set(versions)), (rank, task_id, versions)  # never older, never twice
            after = [v for t, v in installed if t >= reforms[0]["end"]]
            assert len(after) >= 3, (rank, task_id, "installed after the loss:", after)
        print(f"\n[relay-fault] {place=} rank {rank}: re-formed in {reforms[0]['end'] - reforms[0]['start']:.3f} s, "
              f"{reforms[0]['start'] - loss['at']:.2f} s after rank 0 handled the loss; leader pushes dropped "
              f"{group['delta']['pushes_dropped']}")
        late = [r for r in timeline[f"rank{rank}"] if r["stage"] == "group" and r["start"] > loss["at"] and not r["eval"]]
        assert late, f"rank {rank} generated groups after the loss"


def _installs_and_groups(records: list[dict], task_id: str) -> tuple[list[tuple[float, int]], list[float]]:
    installs = [(r["start"], r["version"]) for r in records if r["stage"] == "load_delta" and r["tasks"] == [task_id]]
    groups = [r["start"] for r in records if r["stage"] == "group" and r["tasks"] == [task_id]]
    return installs, groups


def test_a_rank_joined_by_marlaas_scale_gets_a_relay_and_every_version_then_drains(tmp_path):
    run_dir = tmp_path / "run"
    job = Job([str(_relay_config(tmp_path, 1)), "--run-dir", str(run_dir)], tmp_path)
    job.wait_steps(3)
    scale(run_dir, 2)
    job.wait_lines("[scale] rollout rank 4 joined")
    job.wait_steps(job.steps() + 6)
    scale(run_dir, 1)
    job.wait_lines("[scale] rollout rank 4 drained and left")
    assert job.finish() == 0, job.output()
    assert "Exception in thread" not in job.err and "Traceback" not in job.err, job.err[-3000:]
    summary = check_every_version_once(run_dir, STEPS)
    assert [r["rank"] for r in summary["ranks_joined"]] == [4] and [r["rank"] for r in summary["ranks_left"]] == [4]
    timeline = rank_timelines(run_dir)
    first, joined = timeline["rank2"], timeline["rank4"]
    reforms = lambda records: [(r["epoch"], r["relays"]) for r in records if r["stage"] == "relay_reform"]
    assert reforms(joined) == [(1, [2, 4])] and reforms(first) == [(1, [2, 4]), (2, [2])]
    drained_at = [r["end"] for r in first if r["stage"] == "relay_reform"][-1]
    tasks = [task["task_id"] for task in yaml.safe_load((run_dir / "job.yaml").read_text())["tasks"]]
    for task_id in tasks:
        installs, groups = _installs_and_groups(joined, task_id)
        assert installs and groups, (task_id, "the joined rank installed versions and generated groups")
        assert installs[0][0] <= min(groups), (task_id, "a group started before its task's version was here")
        versions = [v for _, v in installs]
        assert versions == sorted(set(versions)), versions
        installs, _ = _installs_and_groups(first, task_id)  # the versions trained after the drain reached rank 2
        after = [v for t, v in installs if t >= drained_at]  # (none were if the task ended first: timing, in CI)
        assert after or installs[-1][1] == STEPS, (task_id, "rank 2 installed nothing after the drain", installs[-3:])
    trained = {r["group_id"] for r in map(json.loads, (run_dir / "audit.jsonl").read_text().splitlines())}
    assert {r["group_id"] for r in joined if r["stage"] == "group" and not r["eval"]} & trained


def test_a_replacement_for_the_only_rollout_rank_gets_the_next_tier_and_every_version(tmp_path):
    run_dir = tmp_path / "run"
    job = Job([str(_relay_config(tmp_path, 1, rollout_replace=True)), "--run-dir", str(run_dir)], tmp_path)
    job.wait_steps(3)
    victim = _rollout_ranks(run_dir)[0]
    os.kill(victim["pid"], signal.SIGKILL)
    job.wait_lines("[scale] rollout rank 4 joined")
    assert job.finish() == 0, job.output()
    assert "Exception in thread" not in job.err and "Traceback" not in job.err, job.err[-3000:]
    summary = check_every_version_once(run_dir, STEPS)
    assert summary["ranks_lost"][0]["rank"] == victim["rank"] and summary["ranks_joined"][0]["rank"] == 4
    replacement = rank_timelines(run_dir)["rank4"]
    assert [(r["epoch"], r["relays"]) for r in replacement if r["stage"] == "relay_reform"] == [(2, [4])]
    for task in yaml.safe_load((run_dir / "job.yaml").read_text())["tasks"]:
        installs, groups = _installs_and_groups(replacement, task["task_id"])
        assert installs and groups and installs[0][0] <= min(groups), task["task_id"]
        # it sampled the last step's groups: it installed a version within the bound of the last one trained
        assert installs[-1][1] >= STEPS - 1 - task["max_staleness"], (task["task_id"], installs[-3:])
