"""The delta plane stays safe on NCCL when a rollout rank, a drained rank or a trainer leader goes (issue #36 item
1): channels left behind are aborted, and a channel's (or relay tier's) set-up has a deadline. No machine here has
two GPUs, so the channels run over tests/support/nccl_standin.py: a gloo group with NCCL's behaviour (a collective waiting
for a missing member never completes, abort() ends it, a watchdog ends a process whose collective stays pending).
Without the aborts each scenario's survivors are ended by the watchdog (exit 6); without the deadline the set-up
waits for gloo's 600 s."""
import pytest

from support.jobs import rank_program

pytestmark = pytest.mark.mpi


def run_scenario(mode: str, ranks: int) -> dict:
    return rank_program("delta_fault_scenarios.py", mode, ranks, timeout=240)


@pytest.mark.parametrize("mode", ["lost_rollout", "drain"])
def test_a_lost_or_drained_rollout_rank_leaves_no_pending_broadcast_on_the_survivors(mode):
    """Version 2 waits for rank 2, which never joins it: the leader remakes its channel over rank 1 and rank 1
    switches to it, each aborting the old group; version 3 arrives and nobody is ended by the watchdog."""
    result = run_scenario(mode, 3)
    assert result["0"] == {"epoch": 1, "broken": None}
    assert result["1"] == {"received": True}


def test_a_lost_trainer_leader_s_channel_is_aborted_by_the_rollout_ranks():
    """Leader 1 announced version 2 and died before broadcasting it: both rollout ranks drop it (aborting its
    channel, where version 2 was posted) and go on receiving leader 0's versions."""
    result = run_scenario("lost_leader", 4)
    assert result["2"] == {"received": True} and result["3"] == {"received": True}


def test_several_leaders_remake_their_channels_over_the_survivor():
    result = run_scenario("several_leaders", 4)
    assert result["0"] == {"epoch": 1, "broken": None} and result["1"] == {"epoch": 1, "broken": None}
    assert result["2"] == {"received": True, "epochs": [1, 1]}


def test_a_member_lost_during_a_channel_s_set_up_fails_it_at_the_deadline_not_the_job():
    """The set-up gives up after its deadline (5 s here) on the leader and the rollout rank; the leader counts the
    version it could not send, and the next epoch carries the newest one."""
    result = run_scenario("setup_deadline", 3)
    leader = result["0"]
    assert leader["broken"] and leader["unsent"] == 1 and leader["epoch"] == 2
    assert 4.5 <= leader["setup_s"] < 30
    assert result["1"] == {"received": True}


def test_a_relay_tier_re_form_with_a_lost_member_fails_at_the_deadline():
    result = run_scenario("relay_deadline", 3)
    assert result["0"] == {"broken": None, "epoch": 2}
    relay = result["1"]
    assert relay["received"] and relay["no_relay_after_failed_reform"] and 4.5 <= relay["reform_s"] < 30
