"""What travels between ranks is defined in one module (runtime/messages.py), and the scheduler's events and
commands do not travel as they are: rank 0 translates at its edge (`to_wire`, `to_event`), so the pure core can
change without changing what goes over MPI (issue #37)."""
import ast
import dataclasses
from pathlib import Path

import pytest

from marlaas_hpc.runtime import messages
from marlaas_hpc.scheduler import events
from marlaas_hpc.scheduler.rank_models import Serve, Served
from marlaas_hpc.tasks import TaskSpec

RUNTIME = Path(__file__).resolve().parents[1] / "marlaas_hpc" / "runtime"


def _init_fields(cls) -> set[str]:
    return {spec.name for spec in dataclasses.fields(cls) if spec.init}


def test_every_event_and_command_that_travels_has_a_wire_form_of_its_name_and_fields():
    travelling = {events.Generated, events.Resumed, events.Scored, events.StepDone, events.TaskFailed, events.Moved,
                  events.Admit, events.Train, events.Move, events.Discard, events.TaskEnded, Serve, Served}
    assert set(messages.WIRE_FORMS) == travelling
    for core, wire in messages.WIRE_FORMS.items():
        assert wire.__module__ == messages.__name__ and wire.__name__ == core.__name__
        assert _init_fields(wire) == _init_fields(core), core.__name__


SAMPLES = [events.Generated(3, ("t/g1", "t/g2"), (4, None)), events.Scored("t/g1", 0.5, False),
           events.StepDone("t", 7, {"loss": 0.1}), events.TaskFailed("t", "reward raised"), events.Moved("t", 1),
           events.Train("t", 6, ("t/g1",), (5,), 1, trainer_group=1, in_use_from=5), events.Move("t", 0, 1, 7),
           events.Discard("t", ("t/g9",), "stale"), events.TaskEnded("t", "failed", "boom"), Serve(2, "chat"),
           Served(2, "chat", 0.5, 1.5), events.Admit(TaskSpec.from_dict({"task_id": "t"}), 3, 1, "t~1")]


@pytest.mark.parametrize("core", SAMPLES, ids=lambda c: type(c).__name__)
def test_rank_0_sends_the_wire_form_and_reads_back_the_same_event(core):
    wire = messages.to_wire(core)
    assert type(wire) is messages.WIRE_FORMS[type(core)]
    assert dataclasses.asdict(wire) == {name: value for name, value in dataclasses.asdict(core).items()
                                        if name in _init_fields(type(wire))}
    back = messages.to_event(wire)
    assert type(back) is type(core) and back == core


def test_a_message_that_is_not_the_scheduler_s_goes_as_it_is():
    shutdown = messages.Shutdown()
    assert messages.to_wire(shutdown) is shutdown and messages.to_event(shutdown) is shutdown


@pytest.mark.parametrize("module", ["env_rank.py", "rollout_rank.py", "trainer_rank.py", "group_guard.py"])
def test_worker_ranks_speak_only_the_wire_forms(module):
    """A worker's loop imports the messages it sends and receives from runtime/messages.py, never the scheduler's
    events or commands (its pure rule for staleness aside)."""
    tree = ast.parse((RUNTIME / module).read_text())
    imported = {(node.module, alias.name) for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                for alias in node.names if node.module and node.module.startswith("marlaas_hpc.scheduler")}
    assert imported <= {("marlaas_hpc.scheduler.staleness", "within_bound")}, imported
