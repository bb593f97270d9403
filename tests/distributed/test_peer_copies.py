"""Peer copies of the local tier (checkpoint/save/peer_copies.py, checkpoint/save/local_recovery.py) with real
processes: two torchrun agents on this machine stand for two nodes of one rank each, each with
its own local folder. Node 0 is lost with its disk (its agent and worker SIGKILLed, its local
folder deleted): the restarted run resumes from rank 0's part as node 1 kept it, bitwise equal
to the continuous world-size-2 run (tests/distributed/conftest.py). With both local folders gone
it falls back to the persistent tier, bitwise too. A damaged peer copy is skipped and reported.
The exchange runs in the background of training, and the last one is waited for at the end; a
partner lost during one stops the copies, not training."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from harness.checkpoint.format import WORLD_SIZE_KEY
from harness.checkpoint.manifest import MANIFEST_FILE
from harness.checkpoint.save.local_recovery import LocalRecovery
from harness.checkpoint.save.node_folders import peer_store
from harness.config import LocalTierSection
from harness.records.run_id import RUN_ID_KEY
from launch import Ranks, run, tail, train_args
from nodes import CADENCE, node_0_lost, restart, steps_in
from procs import assert_same_run, events, harness

STEPS = 12
# Each exchange sleeps this long first (debug.persist_delay_s): longer than the steps between a
# local save and the next, which only a background exchange lets go on meanwhile.
EXCHANGE_DELAY_S = 3.0


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
    held, rejected = LocalRecovery(section, "run-a").held()
    assert [(copy.owner, copy.step) for copy, _ in held] == [(0, 2)]
    (reported,) = rejected
    assert (reported["tier"], reported["owner"], reported["step"]) == ("peer", 0, 4)
    assert ("model.safetensors" if damage == "flip" else "run-b") in reported["problem"]


def test_three_ranks_recover_a_lost_nodes_part_and_refuse_a_copy_damaged_on_the_way(tmp_path):
    """tests/distributed/peer_worker.py: rank 1's folder gone, the ranks agree on step 4, rank 1's
    part comes from rank 2 (rank 0 takes no part in the move) and every rank loads what it saved;
    a resume from step 2 keeps nothing newer; a copy whose bytes differ from its manifest is
    refused by the receiver, nothing committed."""
    log = tmp_path / "worker.log"
    assert run(Ranks((str(tmp_path),), 3, str(Path(__file__).with_name("peer_worker.py"))), log) == 0, tail(log)
    results = [json.loads((tmp_path / f"result-{rank}.json").read_text()) for rank in range(3)]
    for rank, result in enumerate(results):  # every rank loads its own part: the models differ by rank
        assert (result["step"], result["tier"], result["problems"], result["same_model"]) == (4, "peer", [], True)
        assert result["owner"] == rank
    # Rank 1 got back step 4 only (its step 2 went with its node).
    assert [result["kept"] for result in results] == [[2], [], [2]]
    assert "model.safetensors" in results[1]["damaged"] and results[1]["inbox"] == []


def test_ranks_sharing_a_nodes_folder_verify_each_copy_once_and_receive_it_once(tmp_path):
    """tests/distributed/shared_folder_worker.py: ranks 1 and 2 share node 1's folder. Recovering
    with every copy there, each rank loads its own step 4 and node 1's damaged copy of rank 0's is
    verified by one of its ranks (reported once, not by both). With node 1's folder gone, rank 0's
    step 4 serves both its ranks: it crosses to node 1 once, and both load it from the same folder."""
    log = tmp_path / "worker.log"
    assert run(Ranks((str(tmp_path),), 3, str(Path(__file__).with_name("shared_folder_worker.py"))), log) == 0, \
        tail(log)
    results = [json.loads((tmp_path / f"result-{rank}.json").read_text()) for rank in range(3)]
    for rank, result in enumerate(results):
        own = result["own"]
        assert (own["step"], own["owner"], own["tier"], own["same_model"], own["received"]) == (4, rank, "local",
                                                                                               True, [])
        (reported,) = own["rejected"]  # every rank has the same list
        assert reported[0] in (1, 2) and reported[1:] == [0, 4], own["rejected"]
        lost = result["node_lost"]
        assert (lost["step"], lost["owner"], lost["tier"], lost["same_model"]) == (4, 0, "peer", True), lost
    assert [result["node_lost"]["received"] for result in results] == [[], [0], []]
    assert results[1]["node_lost"]["url"] == results[2]["node_lost"]["url"]


def test_the_exchange_runs_while_training_goes_on_and_the_last_one_is_waited_for(tmp_path):
    """World size 2 on one node (peer_jump 1), local saves at 2, 6 and 10, each exchange held
    EXCHANGE_DELAY_S: the steps after a local save are logged before its peer copy is committed,
    a local save's blocking time leaves the exchange out, and at the end of the run every copy,
    the last one too, is committed and verifies."""
    run_dir, local, log = tmp_path / "run", tmp_path / "local", tmp_path / "torchrun.log"
    args = train_args(run_dir, *CADENCE, "--set", f"checkpoint.local.dir='{local}'", "--set",
                      "checkpoint.local.keep=3", "--set", "checkpoint.local.peer_jump=1", "--set",
                      f"debug.persist_delay_s={EXCHANGE_DELAY_S}")
    assert run(args, log) == 0, tail(log)
    (run_folder,) = local.iterdir()
    section = LocalTierSection(dir=str(local), every_steps=2, keep=3)
    logged = {e["step"]: e["time"] for e in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
              if "loss" in e}
    for owner in (0, 1):
        store = peer_store(section, run_folder.name, owner)
        assert [ref.step for ref in store.list()] == [2, 6, 10]
        assert store.verify(store.ref(10)) == []
        committed = (Path(store.ref(2).path) / MANIFEST_FILE).stat().st_mtime
        assert logged[3] < committed - EXCHANGE_DELAY_S / 2, (logged[3], committed)
    first, *later = events(run_dir, "local_checkpoint")
    assert first["step"] == 2 and first["blocking_s"] < EXCHANGE_DELAY_S / 2, first
    assert [e["step"] for e in later] == [6, 10]
    (finished,) = events(run_dir, "exit")
    assert finished["reason"] == "finished"


def test_a_partner_lost_during_the_exchange_stops_the_copies_not_training(tmp_path):
    """tests/distributed/peer_failure_worker.py: rank 1 gone while its exchange is held; rank 0's
    exchange fails on the closed connection (a gloo error, not a damaged copy), its next local
    saves go on at once, the failure logged as a warning and no later exchange tried."""
    log = tmp_path / "worker.log"
    assert run(Ranks((str(tmp_path),), script=str(Path(__file__).with_name("peer_failure_worker.py"))),
               log) == 0, tail(log)
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["stopped"] and result["kept"] == [4, 6]
    assert result["waited"][1] < 1 and result["seconds"] < 60, result
    (warning,) = result["warnings"]
    assert warning["event"].startswith("peer copies stopped") and warning["step"] == 2
    assert "the peer exchange of step 2 failed" in warning["error"] and "Corrupt" not in warning["error"]
