"""Goodput accounting from a synthetic events file, the report command, and the event log."""

import argparse
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from harness.cli.report import run as report
from harness.errors import UserError
from harness.records.events import EventLog
from harness.records.goodput import account
from harness.records.run_files import events_url

REPO = str(Path(__file__).resolve().parents[2])

# A crash after step 15 (checkpoint at 10), a supervisor restart, a resumed process that finishes.
CRASHED_THEN_FINISHED = [
    {"time": 100.0, "event": "start", "resumed_from": None, "startup_s": 2.0},
    {"time": 112.0, "event": "progress", "step": 10, "train_s": 10.0},
    {"time": 113.0, "event": "checkpoint", "step": 10, "blocking_s": 1.0},
    {"time": 118.0, "event": "progress", "step": 15, "train_s": 15.0},
    {"time": 118.5, "event": "restart", "cause": "exit code 13", "exit_code": 13, "step": 10,
     "restart": 1, "backoff_s": 1.5},
    {"time": 122.0, "event": "start", "resumed_from": 10, "startup_s": 2.0},
    {"time": 132.0, "event": "progress", "step": 20, "train_s": 10.0},
    {"time": 133.0, "event": "checkpoint", "step": 20, "blocking_s": 1.0},
    {"time": 134.0, "event": "exit", "reason": "finished", "step": 20, "train_s": 10.0},
]


def test_accounting_of_a_crash_restart_and_recompute():
    g = account(CRASHED_THEN_FINISHED)
    # mean step time = (15 s + 10 s) / (15 + 10 steps) = 1 s; steps 11..15 ran twice.
    assert g.recompute_steps == 5
    assert g.recompute_s == pytest.approx(5.0)
    assert g.training_s == pytest.approx(25.0 - 5.0)
    assert g.saving_s == pytest.approx(2.0)
    assert g.restarting_s == pytest.approx(1.5 + 2.0)  # backoff + startup of the resumed process
    assert g.wall_s == pytest.approx(134.0 - 98.0)
    assert g.other_s == pytest.approx(36.0 - 20.0 - 2.0 - 3.5 - 5.0)
    assert g.goodput == pytest.approx(20.0 / 36.0)
    assert (g.processes, g.restarts, g.last_step, g.exit_reason) == (2, 1, 20, "finished")


def test_a_preemption_at_a_checkpoint_loses_no_steps():
    events = [
        {"time": 0.0, "event": "start", "resumed_from": None, "startup_s": 1.0},
        {"time": 8.0, "event": "progress", "step": 8, "train_s": 8.0},
        {"time": 9.0, "event": "checkpoint", "step": 8, "blocking_s": 1.0},
        {"time": 9.1, "event": "exit", "reason": "preempted", "step": 8, "train_s": 8.0},
        {"time": 60.0, "event": "start", "resumed_from": 8, "startup_s": 3.0},
        {"time": 62.0, "event": "progress", "step": 10, "train_s": 2.0},
    ]
    g = account(events)
    assert g.recompute_steps == 0 and g.training_s == pytest.approx(10.0)
    assert g.restarting_s == pytest.approx(3.0)  # the requeue wait is "other", not restarting
    assert g.exit_reason is None  # the last process has not exited (yet)


def test_crash_before_the_first_checkpoint_recomputes_from_zero():
    events = [
        {"time": 0.0, "event": "start", "resumed_from": None},
        {"time": 4.0, "event": "progress", "step": 4, "train_s": 4.0},
        {"time": 5.0, "event": "start", "resumed_from": None},
        {"time": 9.0, "event": "progress", "step": 4, "train_s": 4.0},
        {"time": 9.5, "event": "gave_up", "cause": "exit code 13", "step": None},
    ]
    g = account(events)
    assert g.recompute_steps == 4 and g.recompute_s == pytest.approx(4.0)
    assert g.exit_reason == "gave_up"


def test_report_prints_the_table(tmp_path, capsys):
    log = EventLog(events_url(str(tmp_path)))
    for e in CRASHED_THEN_FINISHED:
        log.emit(e["event"], **{k: v for k, v in e.items() if k not in ("event", "time")})
    assert report(argparse.Namespace(run_dir=str(tmp_path))) == 0
    out = capsys.readouterr().out
    for row in ("training", "saving (blocking)", "restarting", "recomputing", "wall clock", "goodput"):
        assert row in out
    assert "5 step(s) lost and re-run" in out and "last exit finished" in out


def test_report_without_events_says_what_to_check(tmp_path):
    with pytest.raises(UserError, match="no events file"):
        report(argparse.Namespace(run_dir=str(tmp_path / "nope")))


def test_events_of_a_remote_run_stay_local():
    assert events_url("s3://bucket/runs/a") == "runs/s3-bucket-runs-a-de961c69/events.jsonl"
    assert events_url("s3://bucket/runs/a", log_dir="/logs/a") == "/logs/a/events.jsonl"
    assert events_url("/data/run") == "/data/run/events.jsonl"


def test_processes_appending_at_once_never_tear_a_line(tmp_path):
    writer = textwrap.dedent(
        """
        import sys
        from harness.records.events import EventLog
        log = EventLog(sys.argv[1])
        for i in range(300):
            log.emit("progress", step=i, writer=sys.argv[2], pad="x" * 200)
        """
    )
    url = str(tmp_path / "events.jsonl")
    procs = [subprocess.Popen([sys.executable, "-c", writer, url, str(w)], env={**os.environ, "PYTHONPATH": REPO})
             for w in range(3)]
    assert [p.wait(timeout=30) for p in procs] == [0, 0, 0]
    events = EventLog(url).read()
    assert len(events) == 900
    assert {e["writer"] for e in events} == {"0", "1", "2"}


def test_recomputed_counts_every_step_the_interrupted_process_logged():
    """Progress events come every log_every steps; the resumed process's start event says where
    the previous one really got to (its last metrics line)."""
    events = [
        {"event": "start", "time": 0.0, "resumed_from": None, "startup_s": 0.0},
        {"event": "progress", "time": 10.0, "step": 10, "train_s": 10.0},
        {"event": "checkpoint", "time": 10.0, "step": 10, "blocking_s": 0.0},
        {"event": "start", "time": 20.0, "resumed_from": 10, "previous_reached": 17, "startup_s": 1.0},
        {"event": "exit", "time": 30.0, "reason": "finished", "step": 20, "train_s": 10.0},
    ]
    g = account(events)
    assert g.recompute_steps == 7 and g.last_step == 20


def test_goodput_without_the_local_tier_adds_the_steps_a_local_resume_saved_and_drops_its_saves():
    # Persistent checkpoint at 4, local ones at 2, 4 and 6, a crash after step 7, a resume from
    # the local step 6: without the local tier it would have resumed at 4 (2 more steps re-run).
    events = [
        {"time": 0.0, "event": "start", "resumed_from": None, "startup_s": 1.0},
        {"time": 2.0, "event": "local_checkpoint", "step": 2, "blocking_s": 0.5},
        {"time": 4.0, "event": "checkpoint", "step": 4, "blocking_s": 1.0},
        {"time": 6.5, "event": "local_checkpoint", "step": 6, "blocking_s": 0.5},
        {"time": 7.5, "event": "progress", "step": 7, "train_s": 7.0},
        {"time": 10.0, "event": "start", "resumed_from": 6, "resumed_tier": "local", "startup_s": 1.0},
        {"time": 12.0, "event": "checkpoint", "step": 8, "blocking_s": 1.0},
        {"time": 12.5, "event": "exit", "reason": "finished", "step": 8, "train_s": 2.0},
    ]
    g = account(events)
    assert (g.recompute_steps, g.extra_steps_without_local, g.local_saving_s) == (1, 2, 1.0)
    # mean step 1 s (9 s over 9 steps); wall 13.5 s: without the local tier 13.5 - 1 + 2 = 14.5 s.
    assert g.goodput == pytest.approx(8.0 / 13.5)
    assert g.goodput_without_local == pytest.approx(8.0 / 14.5)
    assert account(CRASHED_THEN_FINISHED).goodput_without_local is None
