"""Rank 0's model pool (issue #28, item 4): one scheduler holding the tasks of two base models, each rollout rank
taking only its model's tasks (Scheduler.rank_models), and RankModels (scheduler/rank_models.py) driving the
ModelPool policy on it under a simulated clock, as rank 0 does under MPI."""
from marlaas_hpc.scheduler import Generate, Generated, RankJoined, RankLeaving, RankLost, StepDone, Submit
from marlaas_hpc.scheduler.rank_models import RankModels, Serve, Served
from marlaas_hpc.scheduler.staleness import within_bound
from support.configs import pool_scheduler as scheduler
from support.configs import task_spec
from support.simloop import SimLoop, _Worker

MODEL = {"a1": "a", "a2": "a", "b1": "b", "b2": "b"}


def spec(task_id, steps=3):
    return task_spec(task_id, steps=steps, model=MODEL[task_id])


def test_a_rank_takes_only_its_models_tasks_and_pending_is_per_model():
    sched = scheduler()
    sched.rank_models.update({1: "a", 2: "b"})
    commands = []
    for task_id in ("a1", "b1"):
        sched.handle(Submit(spec(task_id)))
        commands += sched.handle(StepDone(task_id, 0))
    issued = {(c.rollout_rank, MODEL[c.task_id]) for c in commands if isinstance(c, Generate)}
    assert issued == {(1, "a"), (2, "b")}
    # (k+1)B = 4 groups each, one rank of 2 slots each: 2 of each model wait
    assert sched.pending_rollout("a") == 2 and sched.pending_rollout("b") == 2 and sched.pending_rollout() == 4


class _Tick:
    pass


class _Join:
    def __init__(self, rank):
        self.rank = rank


class PoolLoop(SimLoop):
    """SimLoop with rank 0's model pool: Serve makes the rank answer Served after `switch_s` (once it holds no
    group, as ModelEngines does), a tick every 50 ms. Checks that each rank only ever generates its model's
    groups and that no switch starts with groups of the old model on the rank. A rank that joins (`join_at`)
    comes up with the first model's engine awake, as runtime/main.py builds it; groups sent to a rank while it
    switches to their model wait for the switch (as its ModelEngines holds them)."""

    def __init__(self, sched, durations, models, switch_s=0.3):
        super().__init__(sched, durations)
        self.models = RankModels(sched, models, multi_turn=lambda task_id: False)
        self.switch_s = switch_s
        self.awake = {rank: None for rank in sched.rollout_ranks}
        self.on_rank: dict[int, set] = {rank: set() for rank in sched.rollout_ranks}
        self.switching: dict[int, str] = {}
        self.held: dict[int, list] = {}
        self.wrong: list = []
        self.serves: list[tuple[float, int, str]] = []
        self.first_models = list(models)
        self.generates: list[tuple[float, int, str]] = []

    def join_at(self, rank, at):
        self.at(at, _Join(rank))

    def run(self, max_events=200_000):
        for serve in self.models.start():
            self._execute(serve)
        self.at(0.0, _Tick())
        self.queue.run(until_idle=lambda: self.result.events >= max_events
                       or (self.scheduler.finished() and self.now > 0))
        self.result.end_time = self.now
        return self.result

    def _arrive(self, event):
        if isinstance(event, _Worker):
            event = event.event
        self.result.events += 1
        if isinstance(event, _Tick):
            commands = self.models.tick(self.now)
            self.at(self.models.tick_s, _Tick())
        elif isinstance(event, Served):
            self.awake[event.rollout_rank] = event.model
            self.switching.pop(event.rollout_rank, None)
            commands = self.models.served(event, self.now)[0] + self.held.pop(event.rollout_rank, [])
        elif isinstance(event, _Join):  # its Serve first, then the groups RankJoined gives it
            self.awake[event.rank], self.on_rank[event.rank] = self.first_models[0], set()
            self.waiting_at_join = {m: self.scheduler.pending_rollout(m) for m in self.first_models}
            commands = self.models.joined(event.rank, self.now)
            commands += self.scheduler.handle(RankJoined(event.rank))
        else:
            if isinstance(event, Generated):
                self.on_rank[event.rollout_rank] -= set(event.group_ids)
            commands = self.scheduler.handle(event)
        for command in commands:
            self._execute(command)

    def _execute(self, command):
        if isinstance(command, Serve):
            rank = command.rollout_rank
            if self.on_rank[rank] and self.awake[rank] != command.model:
                self.wrong.append(("switch with groups on the rank", self.now, command))
            self.serves.append((self.now, rank, command.model))
            cost = 0.0 if self.awake[rank] in (None, command.model) else self.switch_s
            self.awake[rank], self.switching[rank] = None, command.model  # switching: nothing generates
            self.at(cost, Served(rank, command.model, 0.0, cost))
            return
        if isinstance(command, Generate):
            self.generates.append((self.now, command.rollout_rank, command.task_id))
            if self.awake[command.rollout_rank] is None and self.switching.get(command.rollout_rank) == \
                    MODEL[command.task_id]:  # the rank's ModelEngines holds it until its engine is awake
                self.held.setdefault(command.rollout_rank, []).append(command)
                self.on_rank[command.rollout_rank] |= {g for g, _ in command.groups}
                return
            if self.awake[command.rollout_rank] != MODEL[command.task_id]:
                self.wrong.append(("group of another model", self.now, command.rollout_rank, command.task_id))
            self.on_rank[command.rollout_rank] |= {g for g, _ in command.groups}
        super()._execute(command)


class Durations:
    """Model a's groups generate in 1 s, b's in 3 s (a bigger model); scoring 0.1 s, a step 0.5 s."""

    def generate(self, task_id, group_id):
        return 1.0 if MODEL[task_id] == "a" else 3.0

    def score(self, task_id, group_id):
        return 0.1

    def train(self, task_id, n_groups):
        return 0.5

    def publish(self, task_id):
        return 0.1


def _run(ranks, tasks, steps=3):
    sched = scheduler(ranks=ranks, slots=2)
    loop = PoolLoop(sched, Durations(), ["a", "b"])
    for task_id in tasks:
        loop.submit(spec(task_id, steps=steps))
    return loop, loop.run()


def _check(loop, result, tasks, steps=3):
    assert loop.wrong == []
    assert result.ended == {task_id: "done" for task_id in tasks}
    for task_id, trains in result.trained_versions.items():
        assert [start for _, start in trains] == list(range(steps)), "every version trained exactly once"
        assert all(within_bound(v, start, 1) for versions, start in trains for v in versions)


def test_one_rank_follows_rank_0_between_two_models_and_every_task_finishes():
    tasks = ["a1", "a2", "b1", "b2"]
    loop, result = _run((1,), tasks)
    _check(loop, result, tasks)
    models = [model for _, _, model in loop.serves]
    assert models[0] == "a" and "b" in models, models
    assert loop.models.policy.switch_s == 0.3, "the pool uses the switch cost the rank measured"


def test_a_rank_whose_model_has_no_work_left_goes_to_the_other_model():
    # a's one short task ends first: its rank goes to b, which then has both ranks
    tasks = ["a1", "b1", "b2"]
    sched = scheduler(ranks=(1, 2), slots=2)
    loop = PoolLoop(sched, Durations(), ["a", "b"])
    loop.submit(spec("a1", steps=1))
    for task_id in ("b1", "b2"):
        loop.submit(spec(task_id, steps=4))
    result = loop.run()
    assert loop.wrong == []
    assert set(result.ended.values()) == {"done"} and set(result.ended) == set(tasks)
    assert (1, "a") == loop.serves[0][1:] and (2, "b") == loop.serves[1][1:]
    assert any(rank == 1 and model == "b" for _, rank, model in loop.serves[2:]), loop.serves


def test_a_rank_that_joins_enters_the_pool_follows_rank_0_and_is_handed_on_later():
    """One rank shared by a and b; a second rank joins at t=1 (`marlaas scale` 1 -> 2) while rank 1 serves a and
    b's groups wait: rank 0 gives it b, the model with the most waiting groups (Serve before any group; a joiner
    comes up with a's engine awake, so it switches first and its first groups wait for that), it takes only its
    assigned model's groups, and later the pool hands it to a and back, as any rank. Every task finishes with
    each version trained once, within its bound."""
    tasks = ["a1", "a2", "b1", "b2"]
    sched = scheduler(ranks=(1,), slots=2)
    loop = PoolLoop(sched, Durations(), ["a", "b"])
    for task_id in tasks:
        loop.submit(spec(task_id, steps=4))
    loop.join_at(2, 1.0)
    result = loop.run()
    _check(loop, result, tasks, steps=4)
    assert loop.waiting_at_join == {"a": 6, "b": 8}
    serves = [(at, model) for at, rank, model in loop.serves if rank == 2]
    assert serves[0] == (1.0, "b") and {model for _, model in serves[1:]} == {"a", "b"}, serves
    assert loop.models.index[2] == 1 and loop.models.model_of(2) == serves[-1][1]
    groups = [(at, MODEL[task_id]) for at, rank, task_id in loop.generates if rank == 2]
    assert groups[0] == (1.0, "b"), "its first groups come with its join, of its model"
    assert loop.models.policy.switch_s == 0.3, "its switch to b was measured like any"


def test_status_names_the_model_each_rollout_rank_serves(tmp_path, capsys):
    import argparse
    import json
    from pathlib import Path

    from marlaas_hpc.cli import cmd_status
    from marlaas_hpc.config import JobConfig
    from marlaas_hpc.runtime.outputs import StatusBoard

    sched = scheduler()
    models = RankModels(sched, ["a", "b"], multi_turn=lambda task_id: False)
    sched.handle(Submit(spec("a1")))
    job = JobConfig.load(Path(__file__).resolve().parents[1] / "configs" / "multi-model-demo.yaml")
    board = StatusBoard(tmp_path, job, sched, 0.0)
    board.changed("a1")
    board.refresh()
    assert json.loads((tmp_path / "status.json").read_text())["rollout_models"] == {"1": "a", "2": "b"}
    sched.rank_models[2] = "a"  # as a Switch sets it
    board.changed("a1")
    board.refresh()
    assert cmd_status(argparse.Namespace(run_dir=str(tmp_path))) == 0
    assert "rollout ranks serve: 1 a, 2 a" in capsys.readouterr().out
    assert models.model_of(2) == "a"


def test_a_joined_rank_shows_in_status_and_a_drained_one_leaves_the_pool_then_the_status(tmp_path):
    import json
    from pathlib import Path

    from marlaas_hpc.config import JobConfig
    from marlaas_hpc.runtime.outputs import StatusBoard

    sched = scheduler(ranks=(1, 2), slots=2)
    models = RankModels(sched, ["a", "b"], multi_turn=lambda task_id: False)
    for task_id in ("a1", "b1", "b2"):
        sched.handle(Submit(spec(task_id)))
        sched.handle(StepDone(task_id, 0))
    assert sched.pending_rollout("b") > sched.pending_rollout("a")
    assert models.joined(3, 1.0) == [Serve(3, "b")], "the joiner (a awake) goes to b, which waits most"
    generates = [c for c in sched.handle(RankJoined(3)) if isinstance(c, Generate)]
    assert generates and {(c.rollout_rank, MODEL[c.task_id]) for c in generates} == {(3, "b")}
    job = JobConfig.load(Path(__file__).resolve().parents[1] / "configs" / "multi-model-demo.yaml")
    board = StatusBoard(tmp_path, job, sched, 0.0)
    board.changed("a1")
    board.refresh()
    assert json.loads((tmp_path / "status.json").read_text())["rollout_models"] == {"1": "a", "2": "b", "3": "b"}
    assert models.served(Served(3, "b", 0.0, 0.2), 1.2) == ([], [])  # it was open already
    assert models.policy.ranks[2].phase == "generating" and models.policy._counts() == {"a": 1, "b": 2}
    # `marlaas scale` down drains rank 3: it leaves the split now (never a donor nor a target)...
    models.leaving(3)
    sched.handle(RankLeaving(3))
    assert models.policy.ranks[2].phase == "released" and models.policy._counts() == {"a": 1, "b": 1}
    assert 2 not in models._demand(2.0, ())["b"].held, "its groups there need no rank of the pool"
    assert all(c.rollout_rank != 3 for c in models.tick(2.0) if isinstance(c, Serve))
    # ...and once gone (RankLost after its drain), the assignment and status.json forget it
    sched.handle(RankLost(3, "rollout"))
    models.lost(3)
    assert models.model_of(3) is None and models.served(Served(3, "b"), 3.0) == ([], [])
    board.changed("a1")
    board.refresh()
    assert json.loads((tmp_path / "status.json").read_text())["rollout_models"] == {"1": "a", "2": "b"}
