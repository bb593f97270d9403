"""PreemptionWatch and SaveDeadline: unit tests, then real processes killed with real signals.

The child is a fake trainer: "steps" are sleeps split in two halves (so a signal can land in
the middle of one), the checkpoint is a JSON file committed by write-temp-then-rename, and it
prints one line per finished step so the test knows how far it got.
"""

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from harness.errors import UserError
from harness.exit_codes import PREEMPTED, SAVE_DEADLINE_MISSED
from harness.process.signals import PreemptionWatch, SaveDeadline

# Children import harness from this checkout, installed or not.
ENV = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}

CHILD = textwrap.dedent(
    """
    import json, os, sys, time
    from harness.exit_codes import PREEMPTED
    from harness.log import configure
    from harness.process.signals import PreemptionWatch, SaveDeadline

    configure()  # as the CLI does: log lines on stderr
    path, step_s, save_s, deadline_s = sys.argv[1], *map(float, sys.argv[2:5])

    def commit(step, slow):
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            f.write(json.dumps({"step": step}))
            f.flush()
            time.sleep(save_s if slow else 0)  # a slow store: the temp file is half done
            os.fsync(f.fileno())
        os.replace(tmp, path)

    commit(0, slow=False)
    step = 0
    with PreemptionWatch() as watch:
        print("ready", flush=True)
        while True:
            if watch.requested:
                print("saving", flush=True)
                with SaveDeadline(deadline_s, since=watch.requested_at):
                    commit(step, slow=True)
                sys.exit(PREEMPTED)
            time.sleep(step_s / 2)
            time.sleep(step_s / 2)
            step += 1
            print(f"step {step}", flush=True)
    """
)


@pytest.fixture
def child(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    ckpt = tmp_path / "ckpt.json"

    def start(step_s=0.05, save_s=0.0, deadline_s=5.0):
        proc = subprocess.Popen(
            [sys.executable, str(script), str(ckpt), str(step_s), str(save_s), str(deadline_s)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV,
        )
        assert proc.stdout.readline() == "ready\n"
        return proc

    return start, ckpt


def finish(proc, timeout=10):
    """Wait for the child; return (exit code, steps it printed, its stderr)."""
    out, err = proc.communicate(timeout=timeout)
    steps = [int(line.split()[1]) for line in out.splitlines() if line.startswith("step ")]
    return proc.returncode, steps, err


# --- unit -----------------------------------------------------------------------------------

def test_watch_records_first_signal_counts_later_ones_and_restores_handlers():
    before = signal.getsignal(signal.SIGUSR1)
    with PreemptionWatch(("SIGUSR1", "TERM")) as watch:
        assert not watch.requested
        os.kill(os.getpid(), signal.SIGUSR1)
        assert watch.requested and watch.signal_name == "SIGUSR1" and watch.count == 1
        first_at = watch.requested_at
        os.kill(os.getpid(), signal.SIGTERM)
        assert watch.count == 2 and watch.signal_name == "SIGUSR1" and watch.requested_at == first_at
    assert signal.getsignal(signal.SIGUSR1) == before


def test_watch_calls_on_signal_with_each_signal():
    seen = []
    with PreemptionWatch(("SIGUSR1",), on_signal=seen.append):
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGUSR1)
    assert seen == [signal.SIGUSR1, signal.SIGUSR1]


def test_unknown_signal_name_is_a_user_error():
    with pytest.raises(UserError, match="SIGNOPE"):
        PreemptionWatch(("SIGNOPE",))


def test_deadline_fires_exit_with_save_deadline_missed():
    exits = []
    deadline = SaveDeadline(0.05, exit=exits.append).start()
    time.sleep(0.5)
    assert exits == [SAVE_DEADLINE_MISSED]
    deadline.done()


def test_deadline_done_in_time_never_fires():
    exits = []
    with SaveDeadline(0.3, exit=exits.append):
        time.sleep(0.01)
    time.sleep(0.4)
    assert exits == []


def test_deadline_counts_from_since_on_the_injected_clock():
    now = [1000.0]
    exits = []
    deadline = SaveDeadline(25, since=970.0, clock=lambda: now[0], exit=exits.append)
    assert deadline.remaining() == pytest.approx(-5.0)
    deadline.start()
    deadline._thread.join(timeout=2)  # already overdue: fires without waiting
    assert exits == [SAVE_DEADLINE_MISSED]


def test_deadline_must_be_positive():
    with pytest.raises(UserError, match="deadline"):
        SaveDeadline(0)


# --- real processes, real signals ------------------------------------------------------------

@pytest.mark.parametrize("delay, sig", [
    (0.0, signal.SIGTERM),  # during the first step
    (0.013, signal.SIGINT),  # mid-step
    (0.06, signal.SIGUSR1),
    (random.Random(7).uniform(0, 0.3), signal.SIGTERM),
])
def test_stop_signal_at_any_point_saves_the_step_in_flight_and_exits_preempted(child, delay, sig):
    start, ckpt = child
    proc = start(step_s=0.05)
    time.sleep(delay)
    sent = time.monotonic()
    proc.send_signal(sig)
    code, steps, err = finish(proc)
    assert code == PREEMPTED, err
    assert time.monotonic() - sent < 3.0
    # The step in flight at the signal was finished and saved; nothing after it was started.
    last = steps[-1] if steps else 0
    assert json.loads(ckpt.read_text()) == {"step": last}
    assert f"received {sig.name}" in err


def test_save_past_the_deadline_exits_76_and_leaves_the_previous_checkpoint(child):
    start, ckpt = child
    proc = start(step_s=0.05, save_s=30.0, deadline_s=0.4)
    time.sleep(0.12)
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    code, steps, err = finish(proc)
    assert code == SAVE_DEADLINE_MISSED, err
    assert time.monotonic() - sent < 0.4 + 2.0  # the deadline, not the 30 s save
    assert steps, "the child should have finished a few steps before the signal"
    assert json.loads(ckpt.read_text()) == {"step": 0}  # still the committed one, and whole
    assert "missed its deadline" in err


def test_second_signal_during_the_save_changes_nothing(child):
    start, ckpt = child
    proc = start(step_s=0.05, save_s=0.6, deadline_s=10.0)
    time.sleep(0.08)
    proc.send_signal(signal.SIGTERM)
    before = []
    while (line := proc.stdout.readline()) != "saving\n":
        before.append(int(line.split()[1]))
    time.sleep(0.1)
    proc.send_signal(signal.SIGINT)  # no KeyboardInterrupt thrown into the save
    proc.send_signal(signal.SIGTERM)
    code, steps, err = finish(proc)
    assert code == PREEMPTED, err
    assert json.loads(ckpt.read_text()) == {"step": before[-1] if before else 0}
    assert "again (#2)" in err and "again (#3)" in err
    assert "Traceback" not in err
