"""Peer copies of the local tier (checkpoint/save/peer_copies.py, checkpoint/save/peer_recovery.py) with real
processes: two torchrun agents on this machine stand for two nodes of one rank each, each with
its own local folder. Node 0 is lost with its disk (its agent and worker SIGKILLed, its local
folder deleted): the restarted run resumes from rank 0's part as node 1 kept it, bitwise equal
to the continuous world-size-2 run (tests/distributed/conftest.py). With both local folders gone
it falls back to the persistent tier, bitwise too. A damaged peer copy is skipped and reported."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from harness.checkpoint.format import WORLD_SIZE_KEY
from harness.checkpoint.save.peer_copies import peer_store
from harness.checkpoint.save.peer_recovery import PeerHoldings
from harness.config import LocalTierSection
from harness.records.run_id import RUN_ID_KEY
from launch import run, tail, torchrun
from nodes import node_0_lost, restart, steps_in
from procs import assert_same_run, events, harness

STEPS = 12


def test_a_lost_node_resumes_from_its_peer_copy_bitwise(tmp_path, continuous):
    run_dir, locals_, logs = node_0_lost(tmp_path)
    (run_folder,) = locals_[1].iterdir()
    # Steps node 1 holds both parts of: its own and its copy of rank 0's.
    whole = steps_in(run_folder / "rank-00001") & steps_in(run_folder / "peer-of-rank-00000")
    assert max(whole) >= 6, whole
    assert steps_in(locals_[0] / run_folder.name / "peer-of-rank-00001")  # node 0 held node 1's, too
    shutil.rmtree(locals_[0])
    restart(run_dir, locals_, logs)
    start = events(run_dir, "start")[-1]
    assert (start["resumed_from"], start["resumed_tier"]) == (max(whole), "peer")
    assert max(whole) in steps_in(locals_[0] / run_folder.name / "rank-00000")  # committed there, then loaded
    assert_same_run(continuous, run_dir, STEPS)
    assert f"step {max(whole)} from the peer tier" in harness("report", str(run_dir), check=True).stdout


def test_both_local_folders_lost_fall_back_to_the_persistent_tier_bitwise(tmp_path, continuous):
    run_dir, locals_, logs = node_0_lost(tmp_path)
    for folder in locals_:
        shutil.rmtree(folder)
    restart(run_dir, locals_, logs)
    start = events(run_dir, "start")[-1]
    assert (start["resumed_from"], start["resumed_tier"]) == (4, "persistent")
    assert_same_run(continuous, run_dir, STEPS)


@pytest.mark.parametrize("damage", ["flip", "other run"])
def test_a_damaged_peer_copy_is_skipped_and_reported(tmp_path, damage):
    """Copies of rank 0's local checkpoints 2 and 4 in this node's folder; 4 damaged (a flipped
    byte, or another run's copy): only 2 may stand in for rank 0's own, 4 is reported."""
    section = LocalTierSection(dir=str(tmp_path), every_steps=2, keep=3)
    store = peer_store(section, "run-a", owner=0)
    for step in (2, 4):
        run_id = "run-b" if damage == "other run" and step == 4 else "run-a"
        store.save(step, {"model": torch.nn.Linear(2, 2)}, meta={RUN_ID_KEY: run_id, WORLD_SIZE_KEY: 1})
    if damage == "flip":
        model = Path(store.ref(4).path) / "model.safetensors"
        data = bytearray(model.read_bytes())
        data[-9] ^= 0x10
        model.write_bytes(bytes(data))
    held, rejected = PeerHoldings(section, "run-a").verified()
    assert held == [(0, 2)]
    (reported,) = rejected
    assert (reported["tier"], reported["owner"], reported["step"]) == ("peer", 0, 4)
    assert ("model.safetensors" if damage == "flip" else "run-b") in reported["problem"]


def test_three_ranks_recover_a_lost_nodes_part_and_refuse_a_copy_damaged_on_the_way(tmp_path):
    """tests/distributed/peer_worker.py: rank 1's folder gone, the ranks agree on step 4, rank 1's
    part comes from rank 2 (rank 0 takes no part in the move) and every rank loads what it saved;
    a resume from step 2 keeps nothing newer; a copy whose bytes differ from its manifest is
    refused by the receiver, nothing committed."""
    log = tmp_path / "worker.log"
    assert run(torchrun(str(Path(__file__).with_name("peer_worker.py")), str(tmp_path), nproc=3, python=True),
               log) == 0, tail(log)
    results = [json.loads((tmp_path / f"result-{rank}.json").read_text()) for rank in range(3)]
    for result in results:
        assert (result["step"], result["tier"], result["problems"], result["same_model"]) == (4, "peer", [], True)
    # Rank 1 got back step 4 only (its step 2 went with its node).
    assert [result["kept"] for result in results] == [[2], [], [2]]
    assert "model.safetensors" in results[1]["damaged"] and results[1]["inbox"] == []
