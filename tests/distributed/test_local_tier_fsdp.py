"""The local checkpoint tier under FSDP at world size 2 (gloo, real processes: launch.Ranks): each
rank's local checkpoint holds its own shards (written through DCP with the rank its own
coordinator) beside the rest of a whole checkpoint. After a SIGKILL of the whole group the run
resumes from the local shards, after the loss of a node (two agents) from its peer copy, both
bitwise equal to the continuous FSDP run (tests/distributed/conftest.py `fsdp_run`); a damaged
local shard is skipped and reported, never loaded, and the run falls back to the persistent tier."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from helpers import flip_byte
from launch import fsdp_args, fsdp_sets, kill_all, run, start, tail, wait_step
from nodes import CADENCE, node_0_lost, restart, steps_in
from procs import assert_same_run, events

STEPS = 12


@pytest.fixture(scope="module")
def killed(tmp_path_factory, fsdp_run) -> tuple[Path, Path]:
    """An FSDP run (persistent at 4, 8, 12; local at 2, 6, 10) whose whole group was SIGKILLed after
    step 7, made once for the module: (its run dir, its local folder). Tests resume copies of it."""
    base = tmp_path_factory.mktemp("killed-fsdp")
    run_dir, local, log = base / "run", base / "local", base / "torchrun.log"
    proc = start(fsdp_args(run_dir, fsdp_run[0], *CADENCE, "--set", f"checkpoint.local.dir='{local}'"), log)
    wait_step(proc, run_dir, 7, log)
    kill_all(proc)
    proc.wait(60)
    return run_dir, local


def copy_of(killed: tuple[Path, Path], tmp_path: Path, arm: str) -> tuple[Path, Path, list[str], Path]:
    """This test's copy of the killed run: (run dir, local folder of the run, the args that resume
    it, log)."""
    run_dir, local = tmp_path / "run", tmp_path / "local"
    shutil.copytree(killed[0], run_dir)
    shutil.copytree(killed[1], local)
    (run_folder,) = local.iterdir()
    args = fsdp_args(run_dir, arm, *CADENCE, "--set", f"checkpoint.local.dir='{local}'")
    return run_dir, run_folder, args, tmp_path / "torchrun.log"


def local_step(run_folder: Path, rank: int, step: int) -> Path:
    return run_folder / f"rank-{rank:05d}" / "checkpoints" / f"step-{step:08d}"


def test_group_sigkill_resumes_from_each_ranks_local_shards_bitwise(tmp_path, fsdp_run, killed):
    arm, continuous = fsdp_run
    run_dir, run_folder, args, log = copy_of(killed, tmp_path, arm)
    for rank in (0, 1):  # its own shards and nothing gathered: half of each sharded weight
        ckpt = local_step(run_folder, rank, 6)
        names = {f["name"] for f in json.loads((ckpt / "manifest.json").read_text())["files"]}
        assert {f"shards-{rank:05d}.safetensors", "dcp-metadata.json", "state.json"} <= names, names
        assert not names & {f"shards-{1 - rank:05d}.safetensors", "model.safetensors", "optim.safetensors"}, names
        weight = json.loads((ckpt / "dcp-metadata.json").read_text())["tensors"]["model/blocks.0.attn.qkv.weight"]
        assert weight["size"] == [96, 32] and weight["chunks"] == [[[48 * rank, 0], [48, 32]]]
    assert run(args, log) == 0, tail(log)
    last_start = events(run_dir, "start")[-1]
    assert (last_start["resumed_from"], last_start["resumed_tier"]) == (6, "local")
    assert not events(run_dir, "checkpoint_rejected", missing_ok=True)
    assert_same_run(continuous, run_dir, STEPS)


def test_a_damaged_local_shard_is_skipped_for_the_persistent_tier_bitwise(tmp_path, fsdp_run, killed):
    """One byte of rank 1's newest local shards flipped: that copy is rejected (by whichever rank
    sharing the folder verified it; reported in rank 0's events), the only other local step both
    hold (2) is older than persistent 4, so both ranks resume from the persistent tier."""
    arm, continuous = fsdp_run
    run_dir, run_folder, args, log = copy_of(killed, tmp_path, arm)
    flip_byte(local_step(run_folder, 1, 6) / "shards-00001.safetensors", at=-3, mask=0x01)
    assert run(args, log) == 0, tail(log)
    last_start = events(run_dir, "start")[-1]
    assert (last_start["resumed_from"], last_start["resumed_tier"]) == (4, "persistent")
    (rejected,) = events(run_dir, "checkpoint_rejected")
    assert (rejected["owner"], rejected["step"]) == (1, 6) and "shards-00001.safetensors" in rejected["problem"]
    assert_same_run(continuous, run_dir, STEPS)


def test_a_lost_node_resumes_from_the_peer_copy_of_its_shards_bitwise(tmp_path, fsdp_run):
    """Two agents of one rank each: node 0 lost with its local folder; its shards come back from
    node 1's peer copy."""
    arm, continuous = fsdp_run
    run_dir, locals_, logs = node_0_lost(tmp_path, *fsdp_sets(arm))
    (run_folder,) = locals_[1].iterdir()
    whole = steps_in(run_folder / "rank-00001") & steps_in(run_folder / "peer-of-rank-00000")
    assert max(whole) >= 6, whole
    copy = run_folder / "peer-of-rank-00000" / "checkpoints" / f"step-{max(whole):08d}"
    assert (copy / "shards-00000.safetensors").is_file()
    shutil.rmtree(locals_[0])
    restart(run_dir, locals_, logs, *fsdp_sets(arm))
    last_start = events(run_dir, "start")[-1]
    assert (last_start["resumed_from"], last_start["resumed_tier"]) == (max(whole), "peer")
    assert_same_run(continuous, run_dir, STEPS)
