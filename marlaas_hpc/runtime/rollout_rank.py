"""Rollout rank: serves every task's generation requests from one engine (continuous batch), receives LoRA
deltas from the trainer leader, and sends finished groups straight to their env rank."""
from __future__ import annotations

import time
from pathlib import Path

from marlaas_hpc.rollout import AdapterRef, GenerationRequest
from marlaas_hpc.runtime.comm import BusyClock, Outbox, poll, write_timeline
from marlaas_hpc.runtime.messages import (TAG_CMD, TAG_DATA, TAG_DELTA, TAG_EVENT, GenerateWork, GroupData,
                                          RankStats, Shutdown)
from marlaas_hpc.scheduler import Generated
from marlaas_hpc.trainer.peft_io import write_peft_adapter


class RolloutRank:
    def __init__(self, comm, engine, delta_group, scratch_dir: Path, seed: int = 0, run_dir: Path | None = None):
        self.comm, self.engine, self.delta = comm, engine, delta_group
        self.run_dir = run_dir
        self.rank = comm.Get_rank()
        self.scratch = Path(scratch_dir)
        self.seed = seed
        self.versions: dict[str, int] = {}
        self.waiting: list[GenerateWork] = []
        self.open_groups: dict[str, dict] = {}
        self.counter = 0
        self.clock = BusyClock()
        self.outbox = Outbox(comm)

    def run(self) -> None:
        while True:
            self.outbox.progress()
            self._drain_deltas()
            command, _ = poll(self.comm, TAG_CMD, source=0)
            if isinstance(command, Shutdown):
                break
            if isinstance(command, GenerateWork):
                self.waiting.append(command)
            self._submit_ready()
            if self.engine.has_unfinished():
                tasks = sorted({entry["work"].task_id for entry in self.open_groups.values()})
                with self.clock.track("generate", tasks):
                    finished = self.engine.step()
                self._collect(finished)
            elif command is None:
                time.sleep(0.002)
        self.outbox.send(RankStats(self.rank, "rollout", self.clock.busy, self.clock.wall()), 0, TAG_EVENT)
        if self.run_dir is not None:
            write_timeline(self.run_dir, self.rank, "rollout", self.clock)
        self.outbox.flush()
        self.engine.close()

    def _drain_deltas(self) -> None:
        """Joins every announced broadcast in order (the leader blocks until all rollout ranks join)."""
        while True:
            announce, _ = poll(self.comm, TAG_DELTA, source=self.delta.leader)
            if announce is None:
                return
            with self.clock.track("load_delta", (announce.task_id,), version=announce.version):
                tensors = self.delta.receive(announce)
                path = self.scratch / announce.task_id / f"v{announce.version:04d}"
                write_peft_adapter(path, tensors, announce.lora)
                self.engine.add_adapter(AdapterRef(announce.task_id, announce.version, str(path)))
            self.versions[announce.task_id] = announce.version

    def _submit_ready(self) -> None:
        """Starts work whose adapter version is here (a Generate may overtake its version's delta). Training
        work asked for a version that is already superseded samples with the newest one instead (older
        versions are retired once unused, and a newer policy is never staler); eval work keeps its version."""
        still_waiting = []
        for work in self.waiting:
            have = self.versions.get(work.task_id, -1)
            if work.version is not None and have < work.version:
                still_waiting.append(work)
                continue
            if work.version is not None and not work.eval:
                work.version = have
            self._submit(work)
        self.waiting = still_waiting

    def _submit(self, work: GenerateWork) -> None:
        requests = []
        for group in work.groups:
            self.open_groups[group.group_id] = {"work": work, "group": group, "done": {}, "t0": time.time()}
            for j in range(work.group_size):
                self.counter += 1
                requests.append(GenerationRequest(
                    request_id=f"{group.group_id}#{j}", task_id=work.task_id, adapter_version=work.version,
                    prompt_ids=group.prompt_ids, temperature=work.temperature, max_new_tokens=work.max_new_tokens,
                    seed=(self.seed * 1_000_003 + self.rank * 7919 + self.counter) % (2**31)))
        self.engine.submit(requests)

    def _collect(self, finished) -> None:
        done_groups = []
        for gen in finished:
            group_id, _, j = gen.request_id.rpartition("#")
            entry = self.open_groups[group_id]
            entry["done"][int(j)] = gen
            if len(entry["done"]) == entry["work"].group_size:
                done_groups.append(group_id)
        for group_id in done_groups:
            entry = self.open_groups.pop(group_id)
            work, group, gens = entry["work"], entry["group"], entry["done"]
            ordered = [gens[j] for j in range(work.group_size)]
            self.clock.note("group", (work.task_id,), entry["t0"], time.time(), group_id=group_id, eval=work.eval,
                            prompt_tokens=len(group.prompt_ids),
                            completion_tokens=[len(g.completion_ids) for g in ordered])
            data = GroupData(work.task_id, group_id, group.prompt_index, work.version, group.prompt_ids,
                             [g.completion_ids for g in ordered], [g.logprobs for g in ordered], eval=work.eval)
            self.outbox.send(data, work.env_rank, TAG_DATA)
            if not work.eval:
                self.outbox.send(Generated(self.rank, (group_id,), (work.version,)), 0, TAG_EVENT)
