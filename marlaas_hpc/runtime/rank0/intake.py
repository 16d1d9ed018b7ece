"""Tasks coming into the job at rank 0: the start specs (the config's `tasks:`, and on a resume every checkpointed
task at its saved state), the queue dir (`marlaas tasks add/cancel`), one submission per turn of the loop, and the
refusals (summary.json's 'rejected', on record so that a resume does not take them)."""
from __future__ import annotations

from collections import deque

from marlaas_hpc.env.tenant_code import check_reward_code
from marlaas_hpc.scheduler import Cancel, Submit
from marlaas_hpc.service import QueueIntake
from marlaas_hpc.tasks import SpecError
from marlaas_hpc.tasks.spec import check_trained, with_base_model


class Intake:
    """`handle(event) -> commands` is the scheduler's (with the run dir's records), `execute(commands)` sends them;
    `busy` is rank 0's BusyClock."""

    def __init__(self, job, run_dir, scheduler, inputs, records, handle, execute, busy, log):
        self.job, self.scheduler, self.inputs, self.records = job, scheduler, inputs, records
        self.handle, self.execute, self.busy, self.log = handle, execute, busy, log
        self.queue = QueueIntake(job, run_dir)
        self.starting: deque = deque()
        """Start specs not submitted yet (`start`)."""
        self.taken: deque = deque()
        """Queue entries taken and checked, not submitted yet: (entry, spec or None, why refused or None)."""
        self.rejected: dict[str, str] = {}

    def pending(self) -> bool:
        """Specs taken (from the start or the queue) and not submitted yet."""
        return bool(self.starting or self.taken)

    def start(self, resume: dict | None, runs: int) -> dict:
        """What the run starts with, (spec, saved record or None) in submission order. Fresh start: the config's
        tasks. Resume: every checkpointed task at its saved state, then any config task the checkpoint does not
        know. The loop submits them one at a time between events (`submit_next`), so that a thousand tasks' v0
        adapters, evals and first rollouts flow while the rest are being admitted. Returns the resume's evals."""
        from marlaas_hpc.tasks import TaskSpec

        evals = {}
        if resume:
            evals = {(e["task_id"], e["when"]): list(e["scores"]) for e in resume["evals"]}
            self.rejected.update(resume["rejected"])
            saved = resume["tasks"]
            self.starting.extend((TaskSpec.from_dict(entry["spec"]), entry["saved"]) for entry in saved.values())
            self.log(f"[job] resuming (run {runs + 1}): " + ", ".join(
                f"{t} {e['saved']['status']} v{e['saved']['version'] or 0}" for t, e in saved.items()))
        known = set(resume["tasks"]) if resume else set()
        self.starting.extend((spec, None) for spec in self.job.tasks if spec.task_id not in known)
        return evals

    def submit(self, spec, resume: dict | None = None, check_code: bool = True) -> list:
        """Admission check of a spec (its data must load); a bad one is refused and never disturbs others.
        check_code: a sandboxed worker loads its reward file first (config tasks; a queued spec's was checked
        by `tasks add`, and one written by hand fails its task at first use: a file that hangs while loading
        must not stall rank 0)."""
        try:
            spec = with_base_model(spec, self.job.model_names())
            check_trained(spec.base_model, self.job.group_models())
            self.inputs.add(spec)
            if check_code:
                check_reward_code(spec.dataset, self.job.sandbox)  # loads in a sandboxed worker, never here
            return self.handle(Submit(spec, resume))
        except (SpecError, ValueError) as exc:
            self.refused(spec.task_id, str(exc))
            self.log(f"[intake] task {spec.task_id!r} refused: {exc}")
            return []

    def refused(self, key: str, reason: str) -> None:
        """A spec refused: listed in summary.json's 'rejected', and on record (a resume does not take it)."""
        self.rejected[key] = reason
        self.records.rejected(key, reason)

    def submit_next(self) -> None:
        spec, saved = self.starting.popleft()
        with self.busy.track("admit"):
            self.execute(self.submit(spec, resume=saved))

    def poll(self, start: float, force: bool = False) -> None:
        """Takes specs and cancel requests from RUN_DIR/queue (`marlaas tasks add/cancel`), every 0.5 s; the specs
        taken are submitted one per call (one per turn of the loop, between events), and the queue is scanned
        again once they all are (a spec stays pending until it is settled)."""
        if self.scheduler.draining:
            return  # preempted: what is queued stays in the queue dir for the resumed job
        if self.taken:
            with self.busy.track("admit"):
                self._settle_next(start)
            return
        if not (self.queue.due() or force):
            return
        with self.busy.track("intake"):
            self._take(start)

    def _settle_next(self, start: float) -> None:
        entry, spec, reason = self.taken.popleft()
        if spec is not None:
            self.execute(self.submit(spec, check_code=False))
            reason = None if spec.task_id in self.scheduler.tasks else self.rejected.get(spec.task_id)
        else:
            self._refused_from_queue(entry, reason)
        self.queue.settle(entry, reason, self.scheduler.tasks.get(spec.task_id) if spec else None, start)

    def _take(self, start: float) -> None:
        self.taken.extend(self.queue.take(self.scheduler.tasks))
        if self.taken:
            self._settle_next(start)
        for task_id, refused in self.queue.cancels(self.scheduler.tasks):
            if refused is not None:
                self.log(f"[intake] cancel of {task_id!r} refused: {refused}")
                continue
            if task_id not in self.scheduler.tasks:
                self.log(f"[intake] cancel of unknown task {task_id!r} ignored")
                continue
            self.log(f"[intake] cancel {task_id!r} requested")
            self.execute(self.handle(Cancel(task_id)))

    def _refused_from_queue(self, entry, reason: str) -> None:
        """Listed in summary.json's 'rejected' like a refused config task (by the queue file's name if its task
        id is taken or unreadable)."""
        spec = (entry.data or {}).get("spec")
        task_id = spec.get("task_id") if isinstance(spec, dict) else None
        key = task_id if isinstance(task_id, str) and task_id not in self.scheduler.tasks \
            and task_id not in self.rejected else entry.name
        self.refused(key, reason)
        self.log(f"[intake] {entry.name} refused: {reason}")

    def serving(self, start: float, evals_pending: bool) -> bool:
        """Every task has ended: a serving job (serve_idle_s) waits for more until closed or idle long enough."""
        self.poll(start)
        if self.taken or not (self.scheduler.finished() and not evals_pending) or self.queue.keep_serving():
            return True
        self.poll(start, force=True)  # a last look: a spec that has just arrived keeps the job up
        return bool(self.taken) or not self.scheduler.finished()
