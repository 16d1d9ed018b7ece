"""Crash safety without MPI jobs: when a task is due for a periodic checkpoint, shard files that refuse to load
when damaged, rank 0's records and their fallback copy, and a resume's roll-back of the append-only outputs."""
import errno
import json
import os

import pytest
import torch

from marlaas_hpc.config import JobConfig
from marlaas_hpc.runtime.checkpoint import (KEEP_SHARDS, CheckpointConfig, CheckpointPolicy, CorruptCheckpoint,
                                            JobRecords, checkpoint_file, load_job_checkpoint, load_torch,
                                            prune_shards, read_records, save_torch, trainer_shard_path)
from marlaas_hpc.runtime.faults import is_job_fault, is_peer_lost
from marlaas_hpc.runtime.recovery import choose_resume_points, crashed_run, rollback_outputs
from marlaas_hpc.scheduler.state import TaskState
from marlaas_hpc.tasks import TaskSpec


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def test_policy_saves_every_n_steps_or_every_t_minutes():
    clock = Clock()
    steps = CheckpointPolicy(CheckpointConfig(every_steps=3, every_minutes=0), clock)
    assert not steps.due("a", 1), "never before the task is admitted"
    steps.admitted("a", 0)
    assert [v for v in range(1, 10) if steps.due("a", v) and (steps.saved("a", v) or True)] == [3, 6, 9]
    steps.admitted("b", 5)  # a resumed task counts from its resumed version
    assert not steps.due("b", 7) and steps.due("b", 8)

    timed = CheckpointPolicy(CheckpointConfig(every_steps=0, every_minutes=2), clock)
    timed.admitted("a", 0)
    clock.now += 119
    assert not timed.due("a", 1)
    clock.now += 1
    assert timed.due("a", 1) and not timed.due("a", 0), "a time trigger needs a new version to save"
    timed.saved("a", 1)
    assert not timed.due("a", 2)

    off = CheckpointPolicy(CheckpointConfig(every_steps=0, every_minutes=0), clock)
    off.admitted("a", 0)
    clock.now += 10_000
    assert not off.due("a", 100)


@pytest.mark.parametrize("change, field", [
    ({"every_steps": -1}, "checkpoint.every_steps"),
    ({"every_steps": 1.5}, "checkpoint.every_steps"),
    ({"every_minutes": -2}, "checkpoint.every_minutes"),
    ({"every_minutes": float("nan")}, "checkpoint.every_minutes"),
    ({"max_crash_requeues": "3"}, "checkpoint.max_crash_requeues"),
    ({"every_step": 2}, "checkpoint.every_step"),
])
def test_job_config_refuses_bad_checkpoint_settings_naming_the_field(change, field):
    with pytest.raises(Exception) as info:
        JobConfig.from_dict({"checkpoint": change})
    assert str(info.value).startswith(field)


def test_shard_with_damaged_bytes_or_no_digest_is_refused_naming_the_file(tmp_path):
    path = tmp_path / "tp0-v000004.pt"
    state = {"adapter": torch.arange(1000, dtype=torch.float32), "version": 4}
    save_torch(state, path)
    assert torch.equal(load_torch(path)["adapter"], state["adapter"])
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte inside the tensor data: torch.load alone would not notice
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpoint, match="tp0-v000004.pt is corrupt"):
        load_torch(path)
    save_torch(state, path)
    path.with_name(path.name + ".sha256").unlink()  # a write cut short between the shard and its digest
    with pytest.raises(CorruptCheckpoint, match="no tp0-v000004.pt.sha256"):
        load_torch(path)


def test_prune_keeps_the_newest_shards_of_this_tp_rank_only(tmp_path):
    for shard in ("tp0", "tp1", "tp0-ep1"):  # tp0-ep1: EP rank 1's experts (layout.trainer_ep)
        for version in (2, 4, 6, 8, 30):  # v30: left by an earlier job in the same run dir
            save_torch({"v": version}, tmp_path / f"{shard}-v{version:06d}.pt")
    prune_shards(tmp_path, "tp0", newest=8)
    names = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("tp0-v") and p.suffix == ".pt")
    assert names == [f"tp0-v{v:06d}.pt" for v in (4, 6, 8)] and KEEP_SHARDS == 3
    assert len([p for p in tmp_path.iterdir() if p.name.startswith("tp0-ep1")]) == 10, "another EP rank's stay"
    prune_shards(tmp_path, "tp0-ep1", newest=6)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("tp0-ep1") and p.suffix == ".pt") == \
        [f"tp0-ep1-v{v:06d}.pt" for v in (2, 4, 6)]
    assert len([p for p in tmp_path.iterdir() if p.name.startswith("tp1")]) == 10, "other TP ranks' files stay"
    prune_shards(tmp_path, "tp1", newest=None)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("tp1")]


def _task(task_id="add", version=0, **state):
    spec = TaskSpec.from_dict({"task_id": task_id, "tenant": "alice", "total_steps": 10,
                               "algo": {"group_size": 2, "batch_prompts": 2}})
    task = TaskState(spec=spec, status="running", version=version, **state)
    return task


def _records_with(tmp_path, tasks=("add",)):
    records = JobRecords(tmp_path)
    records.open_run(1000.0, 5.0)
    for task_id in tasks:
        task = _task(task_id, version=-1)
        task.status = "queued"
        records.submitted(task)
    return records


def _journal_lines(tmp_path) -> list[str]:
    return checkpoint_file(tmp_path).read_text().splitlines(keepends=True)


def test_records_append_one_line_per_change_whatever_the_number_of_tasks(tmp_path):
    """A save, an end, an eval, a refusal: one line each, of a size that does not depend on how many tasks the
    job has (the whole scheduler.json used to be rewritten on each); read back as the state in memory."""
    appended = {}
    for count in (2, 200):
        run_dir = tmp_path / f"n{count}"
        records = _records_with(run_dir, [f"t{i}" for i in range(count)])
        before, lines = checkpoint_file(run_dir).stat().st_size, len(_journal_lines(run_dir))
        task = _task("t1", version=4, next_prompt=12)
        records.saved(task)
        assert len(_journal_lines(run_dir)) == lines + 1
        appended[count] = checkpoint_file(run_dir).stat().st_size - before
    assert abs(appended[200] - appended[2]) < 16, appended  # the digits of seq and time differ, nothing else
    records.ended(_done("t1", 6))
    records.eval_done("t1", "before", [0.5, 1.0])
    records.rejected("bad", "refused: dataset.kind")
    assert len(_journal_lines(run_dir)) == lines + 4
    state = load_job_checkpoint(run_dir)
    assert state["tasks"] == json.loads(json.dumps(records.tasks)) and len(state["tasks"]) == 200
    entry = state["tasks"]["t1"]
    assert entry["saved"]["status"] == "done" and entry["saved"]["version"] == 6
    assert entry["previous"]["version"] is None, "ended keeps the save before"
    assert state["evals"] == [{"task_id": "t1", "when": "before", "scores": [0.5, 1.0]}]
    assert state["rejected"] == {"bad": "refused: dataset.kind"}
    assert state["current_run"] == {"started": 1000.0, "startup_s": 5.0} and state["runs"] == []


def _done(task_id, version):
    task = _task(task_id, version=version)
    task.status = "done"
    return task


@pytest.mark.parametrize("damage", ["flip", "cut"])
def test_a_damaged_or_cut_short_record_falls_back_to_that_key_s_record_before(tmp_path, damage):
    records = _records_with(tmp_path, ["add", "sort"])
    records.saved(_task("add", version=4))
    records.saved(_task("sort", version=2))
    records.saved(_task("add", version=6))
    path = checkpoint_file(tmp_path)
    data = path.read_bytes()
    last = data.rindex(b"\n", 0, len(data) - 1) + 1  # add's v6 record: the last line
    if damage == "flip":
        middle = last + (len(data) - last) // 2
        path.write_bytes(data[:middle] + bytes([data[middle] ^ 0x01]) + data[middle + 1:])
    else:  # a crash in the middle of the write
        path.write_bytes(data[:last + 40])
    warnings = []
    state = load_job_checkpoint(tmp_path, warn=warnings.append)
    assert state["tasks"]["add"]["saved"]["version"] == 4 and state["tasks"]["add"]["previous"]["version"] is None
    assert state["tasks"]["sort"]["saved"]["version"] == 2, "other tasks keep their newest record"
    reason = "crc mismatch" if damage == "flip" else "cut short"
    assert len(warnings) == 1 and "records.jsonl line" in warnings[0] and reason in warnings[0], warnings


def test_compaction_keeps_each_key_s_newest_record_even_if_it_stops_between_its_renames(tmp_path, monkeypatch):
    from marlaas_hpc.runtime import records as journal_module

    monkeypatch.setattr(journal_module, "COMPACT_MIN", 8)
    records = _records_with(tmp_path, ["add", "sort"])
    compactions = 0
    for version in range(1, 12):
        records.saved(_task("add", version=version))
        compactions += records.maybe_compact()
    assert compactions >= 1
    path = checkpoint_file(tmp_path)
    keys = len(records.journal.latest)
    assert len(_journal_lines(tmp_path)) <= max(8, 2 * keys), "appends since the compaction only"
    state = load_job_checkpoint(tmp_path)
    assert state["tasks"]["add"]["saved"]["version"] == 11 and state["tasks"]["add"]["previous"]["version"] == 10
    assert state["tasks"]["sort"]["saved"]["version"] is None
    # a crash between the two renames of a compaction: the journal is in .prev, the new file not in place
    records.journal.compact()
    os.replace(path, path.with_name(path.name + ".prev"))
    assert load_job_checkpoint(tmp_path)["tasks"] == state["tasks"]


def test_a_resume_reads_the_records_back_and_goes_on_from_them(tmp_path):
    records = _records_with(tmp_path, ["add", "sort"])
    records.saved(_task("add", version=4))
    records.saved(_task("add", version=6))
    state = load_job_checkpoint(tmp_path)
    state["tasks"]["add"]["saved"], state["tasks"]["add"]["previous"] = state["tasks"]["add"]["previous"], None
    resumed = JobRecords(tmp_path, state)  # as choose_resume_points leaves it: add falls back to v4
    resumed.runs.append({"started": 1000.0, "ended": "crashed"})
    resumed.open_run(2000.0, 4.0)
    again = load_job_checkpoint(tmp_path)
    assert again["tasks"]["add"]["saved"]["version"] == 4, "the fallback is on record at once"
    assert again["runs"] == [{"started": 1000.0, "ended": "crashed"}] and again["current_run"]["started"] == 2000.0
    resumed.saved(_task("add", version=5))
    assert load_job_checkpoint(tmp_path)["tasks"]["add"]["saved"]["version"] == 5, "seq goes on past the old lines"
    resumed.close_run({"started": 2000.0, "ended": "finished"}, finished=True)
    assert load_job_checkpoint(tmp_path) is None, "a finished job has nothing to resume"
    assert [r["ended"] for r in read_records(tmp_path)["runs"]] == ["crashed", "finished"]


def test_records_of_another_format_are_refused(tmp_path):
    from marlaas_hpc.runtime.records import encode_line

    path = checkpoint_file(tmp_path)
    path.parent.mkdir(parents=True)
    path.write_text(encode_line(1, 0.0, "format", "records", 99))
    with pytest.raises(ValueError, match="checkpoint format 99, this version reads 3"):
        load_job_checkpoint(tmp_path)


def _write_outputs(run_dir, rows_per_version=2):
    audit = []
    for task_id, tenant, top in (("add", "alice", 6), ("sort", "bob", 3)):
        metrics = run_dir / "tasks" / tenant / task_id / "metrics.jsonl"
        metrics.parent.mkdir(parents=True)
        metrics.write_text("".join(json.dumps({"version": v, "loss": 0.0}) + "\n" for v in range(1, top + 1)))
        for v in range(1, top + 1):
            for g in range(rows_per_version):
                audit.append({"task_id": task_id, "group_id": f"{task_id}/g{v * 10 + g}", "sample": 0,
                              "behaviour_version": v - 1, "trained_into": v, "bound": 1})
    (run_dir / "audit.jsonl").write_text("".join(json.dumps(r) + "\n" for r in audit) + '{"task_id": "ad')


def _state(saved: dict[str, tuple[str, int | None]]):
    tasks = {}
    for task_id, (status, version) in saved.items():
        spec = {"task_id": task_id, "tenant": "alice" if task_id == "add" else "bob"}
        tasks[task_id] = {"spec": TaskSpec.from_dict(spec).to_dict(), "previous": None,
                          "saved": {"status": status, "version": version}}
    return {"tasks": tasks}


def test_rollback_cuts_audit_and_metrics_to_the_resumed_versions(tmp_path):
    _write_outputs(tmp_path)
    records = rollback_outputs(tmp_path, _state({"add": ("running", 4), "sort": ("done", 3)}))
    audit = [json.loads(line) for line in (tmp_path / "audit.jsonl").read_text().splitlines()]
    assert sorted({(r["task_id"], r["trained_into"]) for r in audit}) == \
        [("add", v) for v in range(1, 5)] + [("sort", v) for v in range(1, 4)]
    assert len(records) == len(audit) and records[0].group_id == "add/g10", "one record per group, torn line gone"
    versions = [json.loads(line)["version"] for line in (tmp_path / "tasks/alice/add/metrics.jsonl").read_text()
                .splitlines()]
    assert versions == [1, 2, 3, 4]
    assert len((tmp_path / "tasks/bob/sort/metrics.jsonl").read_text().splitlines()) == 3
    rollback_outputs(tmp_path, _state({"add": ("running", None), "sort": ("done", 3)}))
    assert not (tmp_path / "tasks/alice/add/metrics.jsonl").read_text(), "restarting from v0 keeps nothing"


def test_resume_point_falls_back_past_a_corrupt_shard_and_fails_a_task_with_none(tmp_path):
    from mpi4py import MPI

    state = _state({"add": ("running", 6), "sort": ("running", 4)})
    state["tasks"]["add"]["previous"] = {"status": "running", "version": 3}
    state["tasks"]["sort"]["previous"] = {"status": "running", "version": 2}
    for task_id, versions in (("add", (3, 6)), ("sort", (2, 4))):
        spec = TaskSpec.from_dict(state["tasks"][task_id]["spec"])
        for version in versions:
            save_torch({"version": version}, trainer_shard_path(tmp_path, spec, "tp0", version))
    add_v6 = trainer_shard_path(tmp_path, TaskSpec.from_dict(state["tasks"]["add"]["spec"]), "tp0", 6)
    add_v6.write_bytes(add_v6.read_bytes()[:-7])  # cut short
    sort_spec = TaskSpec.from_dict(state["tasks"]["sort"]["spec"])
    for version in (2, 4):
        trainer_shard_path(tmp_path, sort_spec, "tp0", version).unlink()
    logged = []
    chosen = choose_resume_points(MPI.COMM_SELF, tmp_path, state, [0], "tp0", log=logged.append)
    assert chosen["tasks"]["add"]["saved"]["version"] == 3 and chosen["tasks"]["add"]["saved"]["status"] == "running"
    assert chosen["tasks"]["sort"]["saved"]["status"] == "failed"
    assert "tp0-v000004.pt is missing" in chosen["tasks"]["sort"]["saved"]["error"]
    assert any("tp0-v000006.pt is corrupt" in line and "add resumes from its previous checkpoint v3" in line
               for line in logged)


def test_a_crashed_run_enters_the_history_with_its_cause(tmp_path):
    state = {"saved_at": 1100.0, "current_run": {"started": 1000.0, "startup_s": 20.0}}
    assert crashed_run(state, tmp_path)["wall_time_s"] == 100.0
    (tmp_path / "crash.json").write_text(json.dumps({"time": 1050.0, "message": "rank 2 (rollout) died"}))
    run = crashed_run(state, tmp_path)
    assert run["ended"] == "crashed" and run["cause"] == "rank 2 (rollout) died" and run["wall_time_s"] == 50.0
    assert crashed_run({"saved_at": 1.0, "current_run": None}, tmp_path) is None


def test_errors_no_task_caused_are_told_apart():
    gloo = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                        "[127.0.0.1]:19087. This is typically caused by a remote worker crashing.")
    assert is_peer_lost(gloo) and is_job_fault(gloo)
    assert is_job_fault(OSError(errno.ENOSPC, "No space left on device"))
    safetensors_full = RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)")
    assert is_job_fault(safetensors_full) and not is_job_fault(RuntimeError("bad shape (os error 2)"))
    assert not is_job_fault(ValueError("state saved at TP rank 0/2, this is rank 0/1"))
    assert not is_job_fault(FloatingPointError("non-finite loss nan"))
    assert not is_job_fault(OSError(errno.ENOENT, "No such file or directory"))


def test_a_trainer_rank_s_random_state_comes_back_whole_megatron_s_tracker_included(tmp_path):
    """A preemption saves the CPU generator and megatron's model-parallel generators (its CUDA RNG tracker, on the
    CPU twin through the CPU shims); before, only torch's CPU generator was saved."""
    from megatron.core import tensor_parallel

    from marlaas_hpc.runtime.checkpoint import load_torch, rng_state, save_torch, set_rng_state
    from marlaas_hpc.trainer.cpu_shims import apply_cpu_shims

    apply_cpu_shims()
    tracker = tensor_parallel.get_cuda_rng_tracker()
    if "model-parallel-rng" not in tracker.get_states():
        tracker.add("model-parallel-rng", 1234)

    def draws():
        with tracker.fork():
            inside = torch.rand(4)
        return inside, torch.rand(4)

    save_torch(rng_state(), tmp_path / "rng.pt")
    expected = draws()
    draws()  # both generators move on
    set_rng_state(load_torch(tmp_path / "rng.pt"))
    again = draws()
    assert torch.equal(again[0], expected[0]) and torch.equal(again[1], expected[1])


def test_an_older_random_state_file_of_the_cpu_generator_alone_still_loads(tmp_path):
    from marlaas_hpc.runtime.checkpoint import load_torch, save_torch, set_rng_state

    save_torch(torch.get_rng_state(), tmp_path / "rng.pt")
    expected = torch.rand(3)
    set_rng_state(load_torch(tmp_path / "rng.pt"))
    assert torch.equal(torch.rand(3), expected)


def test_a_trainer_rank_on_a_gpu_gets_one_cuda_connection_and_a_rollout_rank_does_not():
    from marlaas_hpc.launch.devices import DeviceBinding, cuda_environment

    def gpu(role):
        return DeviceBinding(rank=3, role=role, device="cuda:0", gpus=("3",), cuda_visible_devices="3")

    assert cuda_environment(gpu("trainer")) == {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    assert cuda_environment(gpu("rollout")) == {}
    cpu = DeviceBinding(rank=3, role="trainer", device="cpu", gpus=(), cuda_visible_devices=None)
    assert cuda_environment(cpu) == {}
