"""Interrupted vs continuous, with real processes and SIGKILL: the finished runs are bitwise equal.

Every optimizer arm runs with dropout and gradient accumulation 2, killed twice at random steps
after the first checkpoint; worker processes are covered by a separate case.
"""

import random
import zlib

import pytest

from helpers import flip_byte
from procs import TINY, assert_one_line_error, assert_same_run, events, final_checkpoint, harness, kill_at_step

STEPS = 12
ARMS = {
    "adamw": [],
    "muon": ["--set", "optim.type=muon"],
    "muon_consistent_rms": ["--set", "optim.type=muon", "--set", "optim.consistent_rms=0.2"],
    "lion": ["--set", "optim.type=lion"],
    "olion": ["--set", "optim.type=olion"],
    "adafactor": ["--set", "optim.type=adafactor"],
    "sgdm": ["--set", "optim.type=sgdm"],
}


def run_pair(tmp_path, extra: list[str], kills: int, seed: int) -> None:
    cont, intr = tmp_path / "continuous", tmp_path / "interrupted"
    harness("train", str(TINY), "--run-dir", str(cont), *extra, check=True)
    rng = random.Random(seed)
    # Kill points after the first checkpoint (step 4); each kill lands wherever the process is:
    # mid-step, mid-save or between steps.
    points = sorted(rng.sample(range(5, STEPS), kills))
    args = ["train", str(TINY), "--run-dir", str(intr), *extra]
    for step in points:
        code = kill_at_step(args, intr, step)
        assert code != 0, "the process finished before it could be killed"
    harness(*args, check=True)
    assert_same_run(cont, intr, STEPS)


@pytest.mark.parametrize("arm", sorted(ARMS))
def test_sigkill_twice_every_arm(tmp_path, arm):
    run_pair(tmp_path, ARMS[arm], kills=2, seed=zlib.crc32(arm.encode()))


def test_sigkill_with_data_workers(tmp_path):
    run_pair(tmp_path, ["--set", "data.num_workers=2", "--set", "optim.type=muon"], kills=1, seed=7)


def test_resumed_twice_from_same_checkpoint_is_identical(tmp_path):
    """Two resumes from one checkpoint (copies of the run dir) finish identically."""
    import shutil

    base = tmp_path / "base"
    args = ["--set", "optim.type=muon"]
    code = kill_at_step(["train", str(TINY), "--run-dir", str(base), *args], base, 9)
    assert code != 0
    copies = [tmp_path / "a", tmp_path / "b"]
    for c in copies:
        shutil.copytree(base, c)
        harness("train", str(TINY), "--run-dir", str(c), *args, check=True)
    assert_same_run(copies[0], copies[1], STEPS)


def test_finished_run_started_again_says_so(tmp_path):
    run = tmp_path / "run"
    harness("train", str(TINY), "--run-dir", str(run), "--set", "train.steps=4", check=True)
    again = harness("train", str(TINY), "--run-dir", str(run), "--set", "train.steps=4")
    assert again.returncode == 0
    assert "already finished at step 4" in again.stderr


def test_a_finished_run_whose_last_checkpoint_is_damaged_trains_its_last_steps_again(tmp_path):
    """A run is finished only if its last checkpoint verifies: a damaged one is skipped like any
    other, the steps after the one before are trained again, and the new last checkpoint is byte
    for byte the first one; with every checkpoint damaged the start is refused (exit 2)."""
    run = tmp_path / "run"
    args = ["train", str(TINY), "--run-dir", str(run), "--set", "train.steps=8"]
    harness(*args, check=True)
    last = final_checkpoint(run, 8) / "model.safetensors"
    original = last.read_bytes()
    flip_byte(last, at=-5, mask=0x40)
    again = harness(*args, check=True)
    assert "already finished" not in again.stderr
    assert "skipping a checkpoint that fails verification" in again.stderr
    assert [e for e in events(run) if e["event"] == "start"][-1]["resumed_from"] == 4
    assert last.read_bytes() == original
    for step in (4, 8):
        flip_byte(final_checkpoint(run, step) / "model.safetensors", at=-5, mask=0x40)
    assert_one_line_error(harness(*args), "fails verification")


@pytest.mark.parametrize("damage", ["flipped byte", "truncated"])
def test_a_damaged_newest_checkpoint_falls_back_to_the_one_before(tmp_path, damage):
    """The resume verifies while it loads: the newest checkpoint is streamed into the live state
    before its damage shows, so the trainer is rebuilt and the one before is loaded; the run
    still finishes bitwise equal to an uninterrupted one."""
    cont, intr = tmp_path / "continuous", tmp_path / "interrupted"
    # Saves inside the step loop, so the kill after step 10 always finds step 8 committed (a
    # background save still in flight at the kill left no step 8 to damage, on a busy machine).
    sync = ["--set", "checkpoint.async_save=false"]
    harness("train", str(TINY), "--run-dir", str(cont), *sync, check=True)
    args = ["train", str(TINY), "--run-dir", str(intr), *sync]
    assert kill_at_step(args, intr, 10) != 0
    newest = final_checkpoint(intr, 8) / "optim.safetensors"
    if damage == "flipped byte":
        flip_byte(newest, at=-5, mask=0x40)
    else:
        newest.write_bytes(newest.read_bytes()[:-7])
    resumed = harness(*args, check=True)
    assert "skipping a checkpoint that fails verification" in resumed.stderr
    start = [e for e in events(intr) if e["event"] == "start"][-1]
    assert start["resumed_from"] == 4
    assert_same_run(cont, intr, STEPS)
