"""lease.py: one writer per run dir; the holder is named; dead holders are taken over, live ones
refused; the stale time follows the holder's heartbeat interval; on the same host the process
itself is checked (zombie, reused pid, exiting)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

import procs
from harness.checkpoint import CheckpointError, CheckpointStore
from harness.checkpoint.lease import ALIVE, DYING, DYING_GRACE_S, GONE, MISSED_HEARTBEATS, Lease, process_state
from harness.storage.location import open_location

HEARTBEAT_S = 150.0  # stale after 600 s


class Clock:
    """A fake clock; `sleep` advances it and runs `on_sleep` (a holder that heartbeats meanwhile)."""

    def __init__(self) -> None:
        self.now = 1_000_000.0
        self.slept = 0.0
        self.on_sleep = lambda: None

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        self.slept += seconds
        self.on_sleep()


def _lease(run_dir: str, owner: str, clock: Clock, host: str = "h1", pid: int = 100, state=lambda pid, started: ALIVE,
           heartbeat_s: float = HEARTBEAT_S, started: float | None = None) -> Lease:
    return Lease(open_location(run_dir), owner, clock=clock, sleep=clock.sleep, host=host, pid=pid, started=started,
                 process_alive=state, heartbeat_s=heartbeat_s)


def test_second_writer_is_refused_with_the_holder_named_once_the_holder_heartbeats(run_dir):
    clock = Clock()
    first = _lease(run_dir, "a", clock)
    first.acquire()
    clock.now += 30
    clock.on_sleep = first.heartbeat  # alive: it beats while the second writer waits
    with pytest.raises(CheckpointError) as err:
        _lease(run_dir, "b", clock, host="h2", pid=7).acquire()
    text = str(err.value)
    assert "writer a (host h1, pid 100, since 1970-01-12T13:46:40Z, last heartbeat" in text
    assert "--takeover" in text
    assert 0 < clock.slept < HEARTBEAT_S * MISSED_HEARTBEATS - 30  # refused at the beat, not at the stale time


def test_a_lost_node_is_taken_over_once_its_heartbeat_is_stale(run_dir, capsys):
    clock = Clock()
    _lease(run_dir, "a", clock, host="h1").acquire()  # the node of "a" is lost: it never beats again
    clock.now += 30
    second = _lease(run_dir, "b", clock, host="h2")
    second.acquire()
    assert second.held
    assert clock.slept == pytest.approx(MISSED_HEARTBEATS * HEARTBEAT_S - 30, abs=HEARTBEAT_S / 4 + 1)
    assert "missed heartbeats" in capsys.readouterr().out


def test_stale_time_is_the_holders_own_interval(run_dir):
    clock = Clock()
    _lease(run_dir, "a", clock, heartbeat_s=10).acquire()
    clock.now += 4 * 10 + 1
    reader = _lease(run_dir, "b", clock, host="h2", heartbeat_s=1000)
    assert "no heartbeat for 41s (more than 40s" in reader.gone_reason(reader.read())
    reader.acquire()
    assert clock.slept == 0


def test_explicit_takeover_and_the_old_holder_notices(run_dir):
    clock = Clock()
    first = _lease(run_dir, "a", clock)
    first.acquire()
    second = _lease(run_dir, "b", clock, host="h2")
    second.acquire(takeover=True)
    with pytest.raises(CheckpointError, match="lost the lease.*writer b"):
        first.check()
    first.release()
    assert json.loads((Path(run_dir) / "lease.json").read_text())["owner"] == "b"


def test_a_live_holder_on_this_host_is_refused_at_once(run_dir):
    clock = Clock()
    _lease(run_dir, "a", clock).acquire()
    with pytest.raises(CheckpointError, match="leased to writer a"):
        _lease(run_dir, "b", clock, pid=5).acquire()
    assert clock.slept == 0


def test_dead_pid_on_the_same_host_is_taken_over_automatically(run_dir, capsys):
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(proc.stdout)
    clock = Clock()
    _lease(run_dir, "a", clock, pid=dead_pid).acquire()
    _lease(run_dir, "b", clock, pid=5, state=process_state).acquire()
    assert "not running on this host" in capsys.readouterr().out


def test_a_zombie_and_a_reused_pid_are_not_alive():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    while psutil.Process(child.pid).status() != psutil.STATUS_ZOMBIE:  # exited, not yet reaped
        time.sleep(0.01)
    assert process_state(child.pid, psutil.Process(child.pid).create_time()) == GONE
    child.wait()
    me = psutil.Process()
    assert process_state(os.getpid(), me.create_time()) == ALIVE
    assert process_state(os.getpid(), me.create_time() - 3600) == GONE  # the pid now names another process


def test_a_holder_that_is_exiting_gets_a_grace_period(run_dir, capsys):
    clock = Clock()
    _lease(run_dir, "a", clock).acquire()
    states = iter([DYING] * 4 + [GONE] * 10)
    _lease(run_dir, "b", clock, pid=5, state=lambda pid, started: next(states)).acquire()
    assert 0 < clock.slept < DYING_GRACE_S
    _lease(run_dir, "c", clock, pid=6, state=lambda pid, started: DYING).acquire()  # after the grace: taken
    assert clock.slept >= DYING_GRACE_S


def test_a_process_with_sigkill_pending_or_exiting_is_dying():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.kill(child.pid, signal.SIGSTOP)  # stopped: the SIGKILL below stays pending
        while psutil.Process(child.pid).status() != psutil.STATUS_STOPPED:
            time.sleep(0.01)
        assert process_state(child.pid, None) == ALIVE
        os.kill(child.pid, signal.SIGKILL)
        assert process_state(child.pid, None) in (DYING, GONE)
    finally:
        child.kill()
        child.wait()


def test_heartbeats_come_from_a_thread_and_a_lost_lease_is_raised_by_poll(run_dir):
    store = CheckpointStore(run_dir, writer_id="one", lease_heartbeat_s=0.05)
    store.acquire_lease()
    path = Path(run_dir) / "lease.json"
    first = json.loads(path.read_text())["heartbeat"]
    deadline = time.monotonic() + 60
    while json.loads(path.read_text())["heartbeat"] == first and time.monotonic() < deadline:
        time.sleep(0.01)
    assert json.loads(path.read_text())["heartbeat"] > first
    store.poll_lease()
    CheckpointStore(run_dir, writer_id="two").acquire_lease(takeover=True)
    while store._lease._failure is None and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(CheckpointError, match="lost the lease.*writer two"):
        store.poll_lease()
    store.release_lease()
    assert json.loads(path.read_text())["owner"] == "two"


def test_a_sigkilled_unreaped_writer_does_not_block_the_restart(tmp_path):
    run_dir, log = tmp_path / "run", tmp_path / "run"
    args = ["train", str(procs.TINY), "--run-dir", str(run_dir)]
    first = procs.start(*args, "--set", "debug.step_sleep_s=0.2")
    procs.wait_for_step(first, log, 2)
    first.send_signal(signal.SIGKILL)  # not waited for: a zombie that still answers kill(pid, 0)
    assert json.loads((run_dir / "lease.json").read_text())["pid"] == first.pid
    again = procs.harness(*args)
    first.wait()
    assert again.returncode == 0, again.stderr[-2000:]


def test_store_lease_context_and_commit_after_losing_it(run_dir):
    store = CheckpointStore(run_dir, writer_id="one")
    with store.lease():
        assert json.loads((Path(run_dir) / "lease.json").read_text())["owner"] == "one"
        with pytest.raises(CheckpointError, match="leased to writer one"):
            CheckpointStore(run_dir, writer_id="two").acquire_lease()
        CheckpointStore(run_dir, writer_id="two").acquire_lease(takeover=True)
        with pytest.raises(CheckpointError, match="lost the lease"):
            store.save(1, {"p": {"x": 1}})
    assert store.list() == []


def test_lease_on_a_memory_store(tmp_path):
    a = CheckpointStore("memory://leased", writer_id="a")
    a.acquire_lease()
    with pytest.raises(CheckpointError, match="writer a"):
        CheckpointStore("memory://leased", writer_id="b").acquire_lease()
    a.release_lease()
    CheckpointStore("memory://leased", writer_id="b").acquire_lease()
    a.loc.fs.rm(a.loc.root, recursive=True)
