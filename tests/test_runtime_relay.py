"""The adapter relay tier (runtime/relay.py, issue #29 item 1). Its version store alone (pins, eviction, refused
layouts, the in-process pull), then tests/support/relay_scenarios.py under mpirun (gloo on the CPU): a pull from the end of
a chain of 3 relays gives the bytes of today's delta broadcast of the same version, and the same logprobs once
installed; a pinned version outlives newer ones until its unpin; a push returns while the last relay of the chain
has not started reading, and every relay then holds the version bit for bit."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from marlaas_hpc.config_loader import SpecError
from marlaas_hpc.runtime.messages import DeltaAnnounce
from marlaas_hpc.runtime.delta.plane import flat_buffer
from marlaas_hpc.runtime.delta.relay import LocalRelayClient, RelayStore, RelayTierLayout
from marlaas_hpc.runtime.delta.relay_plane import job_relay_layout

ROOT = Path(__file__).resolve().parents[1]


def run_relays(mode: str, ranks: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    proc = subprocess.run(["mpirun", "-np", str(ranks), "--oversubscribe", sys.executable,
                           str(ROOT / "tests" / "support" / "relay_scenarios.py"), mode], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def put(store: RelayStore, version: int, task_id: str = "t") -> None:
    store.put(DeltaAnnounce(task_id, version, ["w"], [(2,)], None), torch.full((2,), float(version)))


def test_a_pinned_version_stays_while_pinned_and_goes_once_unpinned_and_superseded():
    store = RelayStore()
    put(store, 1)
    assert store.get("t", 1, pin=True) is not None
    assert store.get("t", 1, pin=True) is not None  # two groups of this rank use v1
    put(store, 2)
    put(store, 3)
    assert store.held("t") == [1, 3], "v2 (superseded, unpinned) stays, or pinned v1 went"
    store.unpin("t", 1)
    assert store.held("t") == [1, 3], "v1 went while a second group still pins it"
    store.unpin("t", 1)
    assert store.held("t") == [3]
    assert store.get("t", 1) is None and torch.equal(store.get("t")[1], torch.full((2,), 3.0))


def test_the_newest_version_stays_when_unpinned_and_an_older_one_arriving_late_does_not_replace_it():
    """A task moved between trainer groups may have v3 reach a relay after v4: v4 stays the newest."""
    store = RelayStore()
    put(store, 4)
    assert store.get("t", 4, pin=True) is not None
    store.unpin("t", 4)
    assert store.held("t") == [4]
    put(store, 3)
    assert store.held("t") == [4] and store.newest("t") == 4
    put(store, 1, task_id="other")
    assert store.held("t") == [4] and store.held("other") == [1]
    with pytest.raises(ValueError, match="not pinned"):
        store.unpin("t", 4)


def test_an_in_process_pull_gives_the_pushed_tensors_and_honours_pins():
    """A rollout rank hosting its node's relay pulls from the store in process (LocalRelayClient)."""
    tensors = {"b.lora_B.weight": torch.randn(6, 2), "a.lora_A.weight": torch.randn(2, 5)}
    names = sorted(tensors)
    store = RelayStore()
    client = LocalRelayClient(store)
    assert client.pull("t") is None
    store.put(DeltaAnnounce("t", 1, names, [tuple(tensors[n].shape) for n in names], None),
              flat_buffer(tensors, names, torch.device("cpu")))
    announce, got = client.pull("t", pin=True)
    assert announce.version == 1 and all(torch.equal(got[n], tensors[n]) for n in tensors) and set(got) == set(tensors)
    put(store, 2)
    assert client.pull("t", 1) is not None and client.pull("t")[0].version == 2
    client.unpin("t", 1)
    assert client.pull("t", 1) is None


@pytest.mark.parametrize("fields, field", [
    (dict(leaders=[], relays=[1]), "relay.leaders"),
    (dict(leaders=[0], relays=[1, 1]), "relay.relays"),
    (dict(leaders=[0], relays=[0, 1]), "relay.leaders"),
    (dict(leaders=[0], relays=[1], clients={2: 3}), "relay.clients"),
    (dict(leaders=[0], relays=[1], fanout=0), "relay.fanout"),
    (dict(leaders=[0], relays=[1], chunk_elems=0), "relay.chunk_elems")])
def test_a_bad_relay_layout_is_refused_naming_the_field(fields, field):
    with pytest.raises(SpecError) as refused:
        RelayTierLayout(**fields).validate()
    assert field in str(refused.value)


def test_a_tree_sends_to_every_relay_once_and_links_are_built_in_one_order():
    layout = RelayTierLayout(leaders=[0, 9], relays=[1, 2, 3, 4, 5], clients={6: 1, 7: 5, 5: 5}, fanout=2)
    assert layout.children(1) == [2, 3] and layout.children(2) == [4, 5] and layout.children(5) == []
    assert layout.parent(1) == [0, 9] and layout.parent(4) == [2]
    pushes = [link for link in layout.links() if link[1] in layout.relays]
    assert sorted(receiver for _, receiver in pushes if _ not in layout.leaders) == [2, 3, 4, 5]
    assert (1, 6) in layout.links() and (5, 7) in layout.links() and (5, 5) not in layout.links()
    assert layout.links() == sorted(layout.links())


@pytest.mark.mpi
def test_a_pull_through_a_chain_of_3_relays_gives_the_broadcast_bytes_and_logprobs_and_keeps_a_pinned_version():
    """The tiny model's adapter, broadcast and pushed: pulled at the end of the chain, v1 (pinned) and v3 equal the
    broadcast tensors bit for bit, and installed as two tasks of one HF engine they give the same greedy tokens
    and logprobs (not the base model's); v1 outlives v2 and v3 while pinned, and goes at its unpin."""
    result = run_relays("bytes", 5)
    assert result == {"ok": True, "pinned_v1_held_after_v3": True, "same_logprobs": True, "v1_after_unpin": False,
                      "v2_after_v3": False}


@pytest.mark.mpi
def test_a_push_returns_before_the_chain_completes_and_every_relay_holds_identical_bytes():
    """The last relay starts reading only once the leader's pushes have returned (a push that waited for the
    chain would hang here); then all three relays hold the newest version bit for bit (the older one evicted)."""
    result = run_relays("chain", 4)
    assert result == {"ok": True, "returned_before_last_relay_read": True, "last_relay_held_when_leader_returned": []}


def test_the_delta_transport_is_broadcast_by_default_and_relay_is_chosen_and_checked_in_the_job_config():
    """`delta.transport` (config.DeltaSettings): relays go with the default fault.on_rank_loss 'continue' (the tier
    is re-formed when a rollout rank is lost, joins or drains) but need 'stop' with several trainer groups (a lost
    leader is not dropped from the tier); a bad transport, fan-out or chunk size is refused naming its field."""
    from support.configs import one_task_job as job

    assert job().delta.transport == "broadcast"
    relays = job(delta={"transport": "relay", "relay_fanout": 2, "relay_chunk_mb": 1}, fault={"on_rank_loss": "stop"})
    assert relays.delta.transport == "relay" and relays.delta.chunk_elems == 1 << 18
    layout = job_relay_layout([3, 4, 5], [6], relays.delta.relay_fanout, relays.delta.chunk_elems).validate()
    assert layout.parent(3) == [6] and layout.children(3) == [4, 5] and layout.clients == {}
    assert job(delta={"transport": "relay"}).fault.on_rank_loss == "continue"
    several = {"layout": {"rollout_ranks": 1, "trainer_groups": 2}}
    assert job(delta={"transport": "relay"}, fault={"on_rank_loss": "stop"}, **several).delta.transport == "relay"
    for fields, field in ((dict(delta={"transport": "relay"}, **several), "delta.transport"),
                          (dict(delta={"transport": "nccl"}), "delta.transport"),
                          (dict(delta={"relay_fanout": 0}), "delta.relay_fanout"),
                          (dict(delta={"relay_chunk_mb": 0}), "delta.relay_chunk_mb")):
        with pytest.raises(SpecError) as refused:
            job(**fields)
        assert field in str(refused.value), (fields, refused.value)
