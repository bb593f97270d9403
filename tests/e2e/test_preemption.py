"""End to end with the real trainer: preemption signals, transient crashes and SIGKILLs under the
supervisor all finish bitwise equal to an uninterrupted run (tests/data/tiny.toml, 12 steps,
a checkpoint every 4). Each real process pays the torch import, so all but the mid-run SIGTERM
case are marked `slow` (the default run includes them; `-m 'not slow'` leaves them out), and each
has a fast counterpart with fake children in tests/process/test_signals.py and test_supervisor.py.
"""

import random
import signal
import time

import pytest

from harness.checkpoint import CheckpointStore
from harness.exit_codes import FINISHED, GAVE_UP, PREEMPTED
from procs import TINY, assert_same_run, events, harness, losses, start, wait_for_step

STEPS = 12
DEADLINE_S = 25.0  # checkpoint.preempt_deadline_s default


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run = tmp_path_factory.mktemp("reference")
    harness("train", str(TINY), "--run-dir", str(run), check=True)
    return run


def restarts(run) -> list[dict]:
    return events(run, "restart")


def sigterm_then_resume(tmp_path, reference, step: int) -> None:
    run = tmp_path / "run"
    args = ["train", str(TINY), "--run-dir", str(run)]
    proc = start(*args)
    wait_for_step(proc, run, step)
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == PREEMPTED, err[-3000:]
    assert time.monotonic() - sent < DEADLINE_S
    # The newest checkpoint verifies and holds the last step trained: none lost after the signal.
    assert CheckpointStore(str(run)).latest_good().step == max(losses(run))
    harness(*args, check=True)
    assert_same_run(reference, run, STEPS)


def test_sigterm_mid_run_exits_preempted_and_resumes_bitwise_equal(tmp_path, reference):
    sigterm_then_resume(tmp_path, reference, step=6)


@pytest.mark.slow
@pytest.mark.parametrize("step", [1, 4], ids=["first-steps", "during-checkpoint-save"])
def test_sigterm_early_or_during_a_save(tmp_path, reference, step):
    sigterm_then_resume(tmp_path, reference, step)


@pytest.mark.slow
def test_transient_crash_is_restarted_by_train_max_restarts(tmp_path, reference):
    run = tmp_path / "run"
    out = harness("train", str(TINY), "--run-dir", str(run), "--max-restarts", "2", "--backoff-initial", "0.1",
                  "--set", "debug.crash_at_step=6")
    assert out.returncode == FINISHED, out.stderr[-3000:]
    assert [(r["cause"], r["step"]) for r in restarts(run)] == [("exit code 13", 4)]
    assert_same_run(reference, run, STEPS)


@pytest.mark.slow
def test_crash_at_the_same_step_every_time_gives_up(tmp_path):
    run = tmp_path / "run"
    out = harness("train", str(TINY), "--run-dir", str(run), "--max-restarts", "5",
                  "--crash-loop-limit", "2", "--backoff-initial", "0.1", "--set", "debug.crash_at_step=6",
                  "--set", "debug.crash_once=false")
    assert out.returncode == GAVE_UP
    assert "gave up at step 4" in out.stderr and "2 times in a row" in out.stderr
    # --backoff-initial reached the supervisor (not the child): 0.1 s, doubled once, plus at most 1 s of jitter
    backoffs = [r["backoff_s"] for r in restarts(run)]
    assert len(backoffs) == 2 and all(b < 0.1 * 2 + 1.0 for b in backoffs), backoffs


@pytest.mark.slow
def test_sigkill_of_the_child_five_times_under_the_supervisor(tmp_path, reference):
    import psutil

    run = tmp_path / "run"
    # 0.5 s steps: a child resumed from step 8 needs its startup (its relay's interpreter, then the
    # forked child's resume: tenths of a second; a fresh interpreter: over a second) plus 2 s of steps
    # to finish, so a kill drawn from 0.5-2 s after it appears always finds it alive (with 0.3 s
    # steps and kills up to 4 s a quiet machine finished the run between two kills).
    # --backoff-initial 0.1: a streak of kills in startup would otherwise wait 1 + 2 + 4 + 8 s
    sup = start("train", str(TINY), "--run-dir", str(run), "--max-restarts", "10",
                "--crash-loop-limit", "10", "--backoff-initial", "0.1", "--set", "debug.step_sleep_s=0.5")
    rng, killed = random.Random(3), set()
    while len(killed) < 5:
        children = psutil.Process(sup.pid).children()
        if not children or children[0].pid in killed:
            time.sleep(0.05)
            continue
        time.sleep(rng.uniform(0.5, 2.0))  # startup takes seconds: land anywhere in it or after
        children[0].kill()
        killed.add(children[0].pid)
    _, err = sup.communicate(timeout=300)
    assert sup.returncode == FINISHED, err[-3000:]
    assert sum(r["cause"] == "killed by SIGKILL" for r in restarts(run)) == 5
    assert_same_run(reference, run, STEPS)
