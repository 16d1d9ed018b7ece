"""A joining rollout rank takes the base weights from a live one (runtime/peer_weights.py, issue 25 Build 5), under
the ULFM Open MPI: the files arrive byte-identical over a chain of two joiners, an engine built from them samples
the same logprobs as one built from the disk, and a feeder that dies mid-transfer leaves the joiner reading the
rest from the disk."""
from __future__ import annotations

import filecmp
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from marlaas_hpc.launch.mpi import find_local_mpi, ulfm_prefix
from marlaas_hpc.runtime.peer_weights import manifest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.mpi,
              pytest.mark.skipif(ulfm_prefix() is None, reason="needs the ULFM Open MPI (tools/setup_env.sh)")]


def _run(ranks: int, tmp_path: Path, model: Path, adapter: Path, *extra: str) -> list[dict]:
    mpi = find_local_mpi("ulfm")
    env = mpi.environ(dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"))
    proc = subprocess.run([*mpi.launch_args(ranks), sys.executable, str(ROOT / "tests" / "support" / "peer_weights_ranks.py"),
                           str(model), str(tmp_path / "out"), str(adapter), *extra],
                          env=env, capture_output=True, text=True, timeout=300)
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, proc.stdout + proc.stderr[-3000:]
    return lines


def _same_files(model: Path, got: Path) -> None:
    assert manifest(got) == manifest(model)
    for name, _ in manifest(model):
        assert filecmp.cmp(model / name, got / name, shallow=False), name


def test_a_chain_of_two_joiners_receives_the_model_byte_identical_and_samples_as_from_disk(
        tmp_path, tiny_model_path, make_lora_adapter):
    (report,) = _run(3, tmp_path, tiny_model_path, make_lora_adapter("peer", seed=5))
    feeder, first, second = report["ranks"]
    assert feeder["turns"] >= 2, "the live rank sent over several turns of its loop (16 chunks of 64 KiB a turn at most)"
    size = sum(s for _, s in manifest(tiny_model_path))
    assert first["peer_bytes"] == size and second["peer_bytes"] == size and not first["fell_back"]
    for joiner in (first, second):
        _same_files(tiny_model_path, Path(joiner["path"]))
    assert report["same_logprobs"] == [True, True, True], "an engine from the received files samples as from disk"


def test_a_feeder_lost_mid_transfer_leaves_the_joiner_reading_the_rest_from_disk(
        tmp_path, tiny_model_path, make_lora_adapter):
    lines = _run(2, tmp_path, tiny_model_path, make_lora_adapter("peer", seed=5), "--kill-feeder-after", "1000000")
    (joiner,) = [line for line in lines if line["rank"] == 1]
    assert joiner["fell_back"] and 0 < joiner["peer_bytes"] < sum(s for _, s in manifest(tiny_model_path))
    (line,) = joiner["lines"]
    assert line.startswith("[join] rank 0 lost while sending the base weights") and "the rest from the disk" in line
    _same_files(tiny_model_path, Path(joiner["path"]))
    assert joiner["logprobs"] == joiner["disk"]


def test_files_whose_crc32_differs_from_the_live_ranks_are_taken_from_disk_down_the_chain(
        tmp_path, tiny_model_path, make_lora_adapter):
    lines = _run(3, tmp_path, tiny_model_path, make_lora_adapter("peer", seed=5), "--bad-sums")
    joiners = [line for line in lines if "path" in line]
    assert sorted(j["rank"] for j in joiners) == [1, 2]
    names = [name for name, _ in manifest(tiny_model_path)]
    for joiner in joiners:
        (line,) = joiner["lines"]
        assert "crc32 differs for" in line and all(name in line for name in names), line
        _same_files(tiny_model_path, Path(joiner["path"]))
