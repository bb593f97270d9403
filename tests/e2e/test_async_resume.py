"""Background saves with real processes: a SIGKILL while a checkpoint is being persisted leaves the
previous checkpoint as the newest good one, and the resumed run is bitwise equal to a continuous
run that saved synchronously (so async and sync saves also agree end to end).

test_resume_bitwise.py covers every optimizer arm with async saves on (the default).
"""

import os
import signal
import time

from harness.checkpoint import CheckpointStore
from procs import TINY, assert_same_run, events, harness, start

STEPS = 12
PERSIST_DELAY_S = 2.0


def steps_of(run, kind: str) -> set[int]:
    return {e["step"] for e in events(run, missing_ok=True) if e["event"] == kind}


def test_sigkill_during_a_background_persist_keeps_the_previous_checkpoint(tmp_path):
    cont, intr = tmp_path / "continuous", tmp_path / "interrupted"
    harness("train", str(TINY), "--run-dir", str(cont), "--set", "checkpoint.async_save=false", check=True)

    # Every persist sleeps first, so the snapshot of step 8 is taken (after waiting for step 4's
    # commit) and then stays in flight for seconds while steps 9.. run: kill it there.
    args = ["train", str(TINY), "--run-dir", str(intr)]
    proc = start(*args, "--set", f"debug.persist_delay_s={PERSIST_DELAY_S}")
    deadline = time.monotonic() + 120
    while 8 not in steps_of(intr, "checkpoint"):
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        assert time.monotonic() < deadline, "no checkpoint event for step 8"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    assert steps_of(intr, "committed") == {4}, "the kill should land while step 8 is being persisted"
    assert CheckpointStore(str(intr)).latest_good().step == 4

    out = harness(*args, check=True)
    starts = [e for e in events(intr) if e["event"] == "start"]
    assert [s["resumed_from"] for s in starts] == [None, 4], out.stderr[-2000:]
    assert_same_run(cont, intr, STEPS)


def test_auto_interval_and_skipped_saves_do_not_change_the_numbers(tmp_path):
    """The continuous run picks its interval with every_steps = "auto" (logged with its inputs);
    the interrupted one saves every step with when_busy = "skip" and slow persists, so most saves
    are skipped, and is killed once some were. Both end bitwise equal: cadence never changes
    what a run computes."""
    cont, intr = tmp_path / "continuous", tmp_path / "interrupted"
    harness("train", str(TINY), "--run-dir", str(cont), "--set", "checkpoint.every_steps=auto",
            "--set", "checkpoint.mtbf_hours=0.01", check=True)
    (choice,) = [e for e in events(cont) if e["event"] == "checkpoint_interval"]
    assert choice["mtbf_s"] == 36.0 and choice["every_steps"] >= 1
    assert choice["interval_s"] >= max((2 * choice["blocking_s"] * 36.0) ** 0.5, choice["persist_s"]) - 1e-9
    assert min(steps_of(cont, "checkpoint")) == 1  # the measuring save

    args = ["train", str(TINY), "--run-dir", str(intr), "--set", "checkpoint.every_steps=1",
            "--set", "checkpoint.when_busy=skip"]
    proc = start(*args, "--set", "debug.persist_delay_s=0.5")
    deadline = time.monotonic() + 120
    while len(steps_of(intr, "checkpoint_skipped")) < 2:
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        assert time.monotonic() < deadline, "no skipped saves"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    assert not steps_of(intr, "checkpoint") & steps_of(intr, "checkpoint_skipped")
    harness(*args, check=True)
    assert_same_run(cont, intr, STEPS)


def test_where_the_process_puts_its_writer_and_its_freed_memory_changes_no_number(tmp_path):
    """`checkpoint.writer_cores` moves the background persist off the training thread's core and
    `train.host_heap` keeps the memory a step frees for the next: a run with both is bitwise the
    run with neither, and its `start` event names the writer's cores and the heap it kept."""
    core = max(os.sched_getaffinity(0))
    placed, anywhere = tmp_path / "placed", tmp_path / "anywhere"
    for run, where, heap in ((placed, f"[{core}]", "keep"), (anywhere, "any", "system")):
        harness("train", str(TINY), "--run-dir", str(run), "--set", "train.cpu_threads=1",
                "--set", f"checkpoint.writer_cores={where}", "--set", f"train.host_heap={heap}", check=True)
    started = {run: [e for e in events(run) if e["event"] == "start"] for run in (placed, anywhere)}
    assert [(e["writer_cores"], e["host_heap"]) for e in started[placed]] == [([core], "keep")]
    assert [(e["writer_cores"], e["host_heap"]) for e in started[anywhere]] == [(None, "system")]
    assert_same_run(anywhere, placed, STEPS)
