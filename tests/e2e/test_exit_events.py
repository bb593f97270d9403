"""Every way a process ends by itself leaves an `exit` event (a crash and a
missed save deadline had none), and goodput counts every re-run step, not only those up to the
last `progress` event (emitted every `train.log_every` steps)."""

import signal

from harness.exit_codes import SAVE_DEADLINE_MISSED
from procs import TINY, events, harness, start, wait_for_step


def test_a_crash_leaves_an_exit_event_and_every_rerun_step_is_counted(tmp_path):
    run = tmp_path / "run"
    args = ["train", str(TINY), "--run-dir", str(run), "--set", "train.steps=8", "--set", "checkpoint.every_steps=5",
            "--set", "train.log_every=100"]  # no progress event between the checkpoint at 5 and the crash at 7
    crashed = harness(*args, "--set", "debug.crash_at_step=7", "--set", 'debug.crash_mode="raise"')
    assert crashed.returncode == 1
    [exit_event] = [e for e in events(run) if e["event"] == "exit"]
    assert exit_event["reason"] == "crashed" and exit_event["exit_code"] == 1 and exit_event["step"] == 7
    assert exit_event["error"] == "RuntimeError: debug.crash_at_step: planned crash after step 7"

    harness(*args, check=True)
    start_event = [e for e in events(run) if e["event"] == "start"][1]
    assert start_event["resumed_from"] == 5 and start_event["previous_reached"] == 7
    report = harness("report", str(run), check=True).stdout
    assert "2 step(s) lost and re-run" in report and "last exit finished" in report


def test_a_missed_save_deadline_leaves_an_exit_event(tmp_path):
    run = tmp_path / "run"
    proc = start("train", str(TINY), "--run-dir", str(run), "--set", "train.steps=1000",
                 "--set", "checkpoint.every_steps=0", "--set", "checkpoint.preempt_deadline_s=1",
                 "--set", "debug.persist_delay_s=60")  # the preemption save cannot finish in time
    wait_for_step(proc, run, 3)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=120)
    assert proc.returncode == SAVE_DEADLINE_MISSED
    [exit_event] = [e for e in events(run) if e["event"] == "exit"]
    assert exit_event["reason"] == "save_deadline_missed" and exit_event["exit_code"] == SAVE_DEADLINE_MISSED
    assert exit_event["signal"] == "SIGTERM" and exit_event["step"] >= 3
