"""background.py: one job at a time, its failure raised once in the owner's thread, `watch`
called while waiting and able to stop the wait."""

from __future__ import annotations

import threading

import pytest

from harness.checkpoint.save.background import BackgroundJob


class Wrapped(Exception):
    pass


def job(watch=None) -> BackgroundJob:
    return BackgroundJob("test-job", "the test job", failed=lambda step, e: Wrapped(f"step {step}: {e}"), watch=watch)


def test_a_failure_is_raised_once_by_the_owner_naming_the_step():
    j = job()
    j.start(3, lambda: 1 / 0)
    assert j.wait(30)
    with pytest.raises(Wrapped, match="step 3: division by zero") as info:
        j.poll()
    assert isinstance(info.value.__cause__, ZeroDivisionError)
    j.poll()  # raised once
    j.finish()


def test_one_job_at_a_time_and_a_running_job_hides_nothing():
    gate = threading.Event()
    j = job()
    j.start(1, gate.wait, 30)
    assert j.busy and j.step == 1
    with pytest.raises(RuntimeError, match="step 1 is still running"):
        j.start(2, lambda: None)
    with pytest.raises(TimeoutError, match="step 1"):
        j.finish(timeout=0.01)
    gate.set()
    j.finish()
    assert not j.busy


def test_watch_runs_while_waiting_and_its_error_stops_the_wait():
    gate, calls = threading.Event(), []

    def watch(step, elapsed):
        calls.append(step)
        if len(calls) == 3:
            raise TimeoutError(f"deadline of step {step}")
        return 0.0

    j = job(watch)
    j.start(7, gate.wait, 30)
    with pytest.raises(TimeoutError, match="deadline of step 7"):
        j.finish()
    assert calls == [7, 7, 7]
    gate.set()
    assert j.wait(30)


def test_close_logs_a_failure_instead_of_raising_it():
    j = job()
    j.start(5, lambda: 1 / 0)
    j.close()  # no exception: the error already propagating stays the one reported
    j.poll()   # and it was taken
