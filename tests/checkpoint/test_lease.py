"""lease.py: one writer per run dir; the holder is named; dead holders are taken over."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from harness.checkpoint import CheckpointError, CheckpointStore
from harness.checkpoint.lease import Lease
from harness.checkpoint.storage import open_location


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def _lease(run_dir: str, owner: str, clock: Clock, host: str = "h1", pid: int = 100, alive=lambda pid: True) -> Lease:
    return Lease(open_location(run_dir), owner, clock=clock, host=host, pid=pid, pid_alive=alive, stale_after_s=600)


def test_second_writer_is_refused_with_the_holder_named(run_dir):
    clock = Clock()
    first = _lease(run_dir, "a", clock)
    first.acquire()
    clock.now += 30
    with pytest.raises(CheckpointError) as err:
        _lease(run_dir, "b", clock, host="h2", pid=7).acquire()
    text = str(err.value)
    assert "writer a (host h1, pid 100, since 1970-01-12T13:46:40Z, last heartbeat 30s ago)" in text
    assert "--takeover" in text


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


def test_dead_pid_on_the_same_host_is_taken_over_automatically(run_dir, capsys):
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(proc.stdout)
    clock = Clock()
    _lease(run_dir, "a", clock, pid=dead_pid, alive=lambda p: True).acquire()
    import psutil
    _lease(run_dir, "b", clock, pid=5, alive=psutil.pid_exists).acquire()
    assert "not running on this host" in capsys.readouterr().out


def test_same_pid_on_another_host_is_not_assumed_dead(run_dir):
    clock = Clock()
    _lease(run_dir, "a", clock, host="h1").acquire()
    with pytest.raises(CheckpointError):
        _lease(run_dir, "b", clock, host="h2", alive=lambda p: False).acquire()


def test_stale_heartbeat_is_taken_over_and_heartbeats_keep_it_fresh(run_dir):
    clock = Clock()
    first = _lease(run_dir, "a", clock)
    first.acquire()
    for _ in range(10):
        clock.now += 100
        first.heartbeat()
    with pytest.raises(CheckpointError):
        _lease(run_dir, "b", clock, host="h2").acquire()
    clock.now += 601
    _lease(run_dir, "b", clock, host="h2").acquire()
    with pytest.raises(CheckpointError, match="lost the lease"):
        first.heartbeat()


def test_heartbeat_writes_at_most_every_interval(run_dir):
    clock = Clock()
    lease = _lease(run_dir, "a", clock)
    lease.acquire()
    path = Path(run_dir) / "lease.json"
    clock.now += 10
    lease.heartbeat()
    assert json.loads(path.read_text())["heartbeat"] == 1_000_000.0
    clock.now += 60
    lease.heartbeat()
    assert json.loads(path.read_text())["heartbeat"] == 1_000_070.0


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
