"""Background saves at world size 2 (gloo, launch.Ranks): the whole group SIGKILLed at random moments
while a checkpoint is being persisted in the background, then started again, finishes bitwise
equal to the continuous run (final checkpoint and every step's loss)."""

from __future__ import annotations

import os
import random
import time

from harness.checkpoint import CheckpointStore
from launch import kill_all, run, start, tail, train_args
from procs import assert_same_run, events

STEPS = 12
PERSIST_DELAY_S = 1.0  # each background persist sleeps this long first: the window the kills land in
ASYNC = ["--set", "checkpoint.async_save=true", "--set", f"debug.persist_delay_s={PERSIST_DELAY_S}"]


def wait_for_event(proc, run_dir, kind: str, step: int, log, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    seen = len([e for e in events(run_dir, missing_ok=True) if e["event"] == kind and e["step"] == step])
    while len([e for e in events(run_dir, missing_ok=True) if e["event"] == kind and e["step"] == step]) == seen:
        assert proc.poll() is None, f"exited {proc.returncode} before {kind} {step}:\n{tail(log)}"
        assert time.monotonic() < deadline, f"no {kind} event for step {step}:\n{tail(log)}"
        time.sleep(0.01)


def test_group_sigkill_during_background_persists_resumes_bitwise(tmp_path, continuous):
    seed = int.from_bytes(os.urandom(4), "little")
    rng = random.Random(seed)
    run_dir, log = tmp_path / "run", tmp_path / "torchrun.log"
    args = train_args(run_dir, *ASYNC)
    for _ in range(2):
        proc = start(args, log)
        wait_for_event(proc, run_dir, "checkpoint", 8, log)  # rank 0 snapshotted step 8; every rank persists it
        time.sleep(rng.uniform(0, 0.8 * PERSIST_DELAY_S))
        kill_all(proc)  # both trainers at once, mid-persist
        proc.wait(60)
        committed = [e["step"] for e in events(run_dir, missing_ok=True) if e["event"] == "committed"]
        assert 8 not in committed, f"seed {seed}: the kill landed after the commit of step 8"
        assert CheckpointStore(str(run_dir)).latest_good().step == 4, f"seed {seed}"
    assert run(args, log) == 0, tail(log)
    starts = [e["resumed_from"] for e in events(run_dir, missing_ok=True) if e["event"] == "start"]
    assert starts == [None, 4, 4], f"seed {seed}: {starts}"
    assert_same_run(continuous, run_dir, STEPS)
    assert CheckpointStore(str(run_dir)).incomplete() == [], "the killed persists' folders were left behind"
