"""Retention of adapter versions (runtime/retention.py): which versions a task's adapters/ dir keeps, that a
version still in flight is never deleted (the scheduler's real bookkeeping of a multi-turn group that pins an
old version while newer ones land; a real engine's pins and requests on a rollout rank), and the config."""
import pytest

from marlaas_hpc.config import JobConfig
from marlaas_hpc.rollout import AdapterRef, GenerationRequest, make_engine
from marlaas_hpc.runtime.retention import RetentionConfig, in_flight_versions, prune_adapters, version_dirs
from marlaas_hpc.scheduler import Generated, Scheduler, SchedulerConfig, Scored, StepDone, Submit, Train
from marlaas_hpc.tasks import TaskSpec
from marlaas_hpc.trainer.peft_io import read_peft_adapter


def _versions(folder, versions):
    for v in versions:
        (folder / f"v{v:04d}").mkdir(parents=True)
        (folder / f"v{v:04d}" / "adapter_model.safetensors").write_bytes(b"w")


def test_policy_keeps_the_last_k_every_nth_the_newest_and_pins():
    policy = RetentionConfig(keep_last=2, keep_every=10)
    kept = [v for v in range(31) if policy.keeps(v, 30, pinned={7})]
    assert kept == [0, 7, 10, 20, 29, 30]
    assert [v for v in range(13) if policy.keeps(v, 12)] == [0, 10, 11, 12]
    assert [v for v in range(6) if RetentionConfig(keep_last=0, keep_every=0).keeps(v, 5)] == [5], "newest always"
    assert all(RetentionConfig(keep_every=1).keeps(v, 9) for v in range(10)), "keep_every 1 keeps all"


def test_prune_deletes_what_nothing_keeps_and_leftovers_above_the_newest(tmp_path):
    _versions(tmp_path, range(0, 9))
    (tmp_path / ".v0009.tmp-abcd").mkdir()  # a PEFT write being staged: not a version dir
    deleted = prune_adapters(tmp_path, RetentionConfig(keep_last=2, keep_every=3), newest=6, pinned=[1],
                             in_flight={4})
    assert deleted == [2, 7, 8], "v7/v8: left by a rolled-back run, rewritten when trained again"
    assert sorted(version_dirs(tmp_path)) == [0, 1, 3, 4, 5, 6]
    assert (tmp_path / ".v0009.tmp-abcd").is_dir()
    assert not [p for p in tmp_path.iterdir() if ".del-" in p.name], "deleted dirs leave nothing behind"


def test_in_flight_covers_the_oldest_group_to_the_newest_the_window_and_the_checkpoint():
    assert in_flight_versions(10, 9, None, 1, None) == {9, 10}
    assert in_flight_versions(10, 9, 4, 1, None) == set(range(4, 11)), "a group issued at v4 may sample v4..v10"
    assert in_flight_versions(10, 9, None, 3, 5) == {5, 7, 8, 9, 10}
    assert in_flight_versions(1, 0, None, 5, None) == {0, 1}


def _drive(scheduler, events):
    out = []
    for event in events:
        out += scheduler.handle(event)
    return out + scheduler.dispatch()


def _finished(*group_ids):
    return [e for gid in group_ids for e in (Generated(1, (gid,)), Scored(gid, 0.5))]


def test_a_multi_turn_group_on_an_old_version_keeps_it_while_newer_versions_land(tmp_path):
    """The real scheduler and the trainer's pruning: group t/g0 is issued at v0 and stays open (an episode
    waiting on its tool) while the task trains to v3; v0 is past the staleness window (k=1) from v2 on, and
    a policy of keep_last=1 alone would drop it. It stays until the group is over (here: dropped as stale),
    then goes at the next step."""
    spec = TaskSpec.from_dict({"task_id": "t", "max_staleness": 1, "total_steps": 6,
                               "algo": {"batch_prompts": 2, "group_size": 2}})
    scheduler = Scheduler(SchedulerConfig(rollout_ranks=(1,), env_ranks=(9,), rollout_slots=8), clock=lambda: 0.0)
    policy, folder = RetentionConfig(keep_last=1, keep_every=0), tmp_path / "adapters"
    _drive(scheduler, [Submit(spec)])
    _versions(folder, [0])
    _drive(scheduler, [StepDone("t", 0)])  # issues t/g0..t/g3 at v0
    kept_v0 = []
    for version, done in ((1, ("t/g1", "t/g2")), (2, ("t/g3", "t/g4")), (3, ("t/g5", "t/g6")),
                          (4, ("t/g0", "t/g7", "t/g8")), (5, ("t/g9", "t/g10"))):
        [order] = [c for c in _drive(scheduler, _finished(*done)) if isinstance(c, Train)]
        _versions(folder, [version])  # the trainer publishes the step's version, then prunes
        prune_adapters(folder, policy, version, (), in_flight_versions(version, order.from_version,
                                                                        order.in_use_from, order.bound, None))
        kept_v0.append(0 in version_dirs(folder))
        _drive(scheduler, [StepDone("t", version)])
    assert kept_v0 == [True, True, True, False, False], "v0 stays exactly while t/g0 is open"
    assert sorted(version_dirs(folder)) == [4, 5]


@pytest.mark.parametrize("change, field", [
    ({"adapters": {"keep_last": -1}}, "adapters.keep_last"),
    ({"adapters": {"keep_every": 1.5}}, "adapters.keep_every"),
    ({"adapters": {"keep": 3}}, "adapters.keep"),
    ({"adapters": []}, "adapters"),
    ({"adapters": {"keep_final_checkpoint": "yes"}}, "adapters.keep_final_checkpoint"),
    ({"tasks": [{"task_id": "a", "total_steps": 5, "keep_versions": [2, 6]}]}, "tasks[0].keep_versions[1]"),
    ({"tasks": [{"task_id": "a", "keep_versions": 3}]}, "tasks[0].keep_versions"),
])
def test_job_config_refuses_bad_retention_naming_the_field(change, field):
    with pytest.raises(ValueError) as err:
        JobConfig.from_dict(change)
    assert str(err.value).startswith(f"{field}:"), str(err.value)


def test_retention_config_and_pins_load():
    job = JobConfig.from_dict({"adapters": {"keep_last": 3, "keep_every": 0},
                               "tasks": [{"task_id": "a", "total_steps": 9, "keep_versions": [4, 9]}]})
    assert (job.adapters.keep_last, job.adapters.keep_every) == (3, 0)
    assert job.tasks[0].keep_versions == (4, 9)
    assert TaskSpec.from_dict(job.tasks[0].to_dict()).keep_versions == (4, 9), "round trip (checkpoint records)"
    assert JobConfig.from_dict({}).adapters == RetentionConfig(keep_last=2, keep_every=10,
                                                               keep_final_checkpoint=False)


def test_rollout_versions_leave_the_engine_only_when_it_retires_them(tiny_model_path, adapters, codec):
    """A rollout rank's in-memory versions with a real engine: a version pinned by an episode, or used by a
    request in flight, stays loaded while newer versions land; each goes once the engine retired it."""
    lora, tensors = read_peft_adapter(adapters["t1"])
    engine = make_engine("hf", tiny_model_path)

    def land(version):
        engine.add_adapter(AdapterRef("t", version, tensors=tensors, lora=lora))
        return [(ref.task_id, ref.version) for ref in engine.pop_retired()]

    live = lambda: sorted(v for _, v in engine.loaded_adapters())  # noqa: E731
    assert land(0) == []
    engine.pin("t", 0)  # an episode between turns
    assert land(1) == []
    engine.submit([GenerationRequest("r1", "t", 1, codec.encode_prompt("1+2="), temperature=0.0,
                                     max_new_tokens=2)])
    assert land(2) == [] and live() == [0, 1, 2]
    engine.unpin("t", 0)
    assert [(r.task_id, r.version) for r in engine.pop_retired()] == [("t", 0)] and live() == [1, 2]
    while engine.has_unfinished():
        engine.step()
    assert [(r.task_id, r.version) for r in engine.pop_retired()] == [("t", 1)] and live() == [2]
    engine.close()
