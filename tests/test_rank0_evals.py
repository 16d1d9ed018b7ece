"""Rank 0's evals (runtime/rank0/evals.py) when a task's two evals are out at once.

A task that ends before the answers of its base-model eval are in (a one-step task on a loaded machine: seen in
CI, where the job then waited for its final eval until the test's timeout) has its 'before' and 'after' evals out
together. Each prompt is tracked by its group id, so the two evals' prompts need distinct ids, or the base eval's
answers consume the final eval's entries and the final eval's answers are dropped as duplicates."""
from pathlib import Path

from marlaas_hpc.config import JobConfig
from marlaas_hpc.model import TextCodec
from marlaas_hpc.runtime.messages import EvalDone
from marlaas_hpc.runtime.rank0.evals import Evals
from marlaas_hpc.runtime.rank0.inputs import TaskInputs
from marlaas_hpc.scheduler import Scheduler
from marlaas_hpc.scheduler.events import Submit

ROOT = Path(__file__).resolve().parents[1]


class Sent:
    """Rank 0's outbox as the ranks see it: every message, in order."""

    def __init__(self):
        self.messages = []

    def send(self, message, rank, tag):
        self.messages.append((message, rank))


class Books:
    def __init__(self):
        self.evals = {}

    def eval_done(self, task_id, when, scores):
        self.evals[(task_id, when)] = list(scores)


def _evals(tiny_model_path):
    job = JobConfig.load(ROOT / "configs" / "local-demo.yaml")
    scheduler = Scheduler(job.scheduler_config([2], [1]), clock=lambda: 0.0)
    spec = job.tasks[0]
    scheduler.handle(Submit(spec))
    inputs = TaskInputs(job, scheduler, TextCodec.from_pretrained(tiny_model_path))
    inputs.add(spec)
    outbox, books = Sent(), Books()
    return Evals(scheduler, inputs, outbox, books, log=lambda line: None), outbox, books, spec.task_id


def _answer(evals, outbox, accuracy):
    """The env rank's EvalDone for each prompt of the eval messages sent so far, oldest first."""
    sent, outbox.messages = outbox.messages, []
    for work, _ in sent:
        for group in work.groups:
            evals.done(EvalDone(work.task_id, work.version, accuracy, 1, group.group_id))


def test_an_after_eval_sent_before_the_base_eval_is_answered_completes_both(tiny_model_path):
    evals, outbox, books, task = _evals(tiny_model_path)
    evals.admitted(task)
    evals.generated(task)  # the base eval goes out with the task's first Generate
    before = list(outbox.messages)
    evals.send(task, 1)  # the task ended at v1 before any answer of its base eval came in
    after = outbox.messages[len(before):]
    ids = [g.group_id for work, _ in before + after for g in work.groups]
    assert len(ids) == len(set(ids)), "the two evals' prompts share group ids"
    _answer(evals, outbox, 1.0)
    assert not evals.pending, f"evals still waiting: {evals.pending}"
    prompts = len(before[0][0].groups)
    assert books.evals == {(task, "before"): [1.0] * prompts, (task, "after"): [1.0] * prompts}
