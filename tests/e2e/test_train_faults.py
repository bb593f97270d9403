"""Faults inside a real `harness train` process (HARNESS_FAULTS), then a restart: the resumed
run finishes bitwise equal to an uninterrupted one."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

import procs
from harness.checkpoint import CheckpointStore
from procs import TINY, assert_same_run, harness

pytestmark = pytest.mark.usefixtures("quiet_logs")  # tests/conftest.py

STEPS = 12          # tests/data/tiny.toml: checkpoints at 4, 8, 12


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, list[tuple[int, str, str]]]:
    """An uninterrupted run with the fault layer counting, and its storage-operation trace."""
    run = tmp_path_factory.mktemp("torture-train") / "reference"
    trace = run.parent / "trace.txt"
    mp = pytest.MonkeyPatch()
    mp.setitem(procs.ENV, "HARNESS_FAULTS", "count")
    mp.setitem(procs.ENV, "HARNESS_FAULTS_TRACE", str(trace))
    try:
        harness("train", str(TINY), "--run-dir", str(run), check=True)
    finally:
        mp.undo()
    ops = [(int(n), op, path) for n, op, path in (line.split(" ", 2) for line in trace.read_text().splitlines())]
    return run, ops


def _first(ops, op: str, needle: str, file: str = "") -> int:
    """The number of the first `op` on a path containing `needle` and ending with `file`."""
    return next(n for n, o, path in ops if o == op and needle in path and path.endswith(file))


def _faulty_run(tmp_path, monkeypatch, spec: str):
    run = tmp_path / "run"
    monkeypatch.setitem(procs.ENV, "HARNESS_FAULTS", spec)
    proc = harness("train", str(TINY), "--run-dir", str(run))
    monkeypatch.delitem(procs.ENV, "HARNESS_FAULTS")
    return run, proc


def _after_fault(run: Path) -> CheckpointStore:
    store = CheckpointStore(str(run))
    good = store.latest_good()
    assert good is not None and good.step == 4, "the checkpoint before the failed save must be the newest good one"
    assert not store.verify(good)
    return store


def test_kill_inside_a_save_then_resume_is_bitwise_equal(reference, tmp_path, monkeypatch):
    ref_run, ops = reference
    # The last moment before the commit: every file written, the manifest not yet fsynced. Every
    # other point of a save is covered at the store level by tests/verify/test_torture.py.
    at = _first(ops, "fsync", "step-00000008.tmp-", "manifest.json")
    run, proc = _faulty_run(tmp_path, monkeypatch, f"kill@{at}")
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    _after_fault(run)
    harness("train", str(TINY), "--run-dir", str(run), check=True)
    assert_same_run(ref_run, run, STEPS)
    assert not CheckpointStore(str(run)).incomplete()


def test_disk_full_inside_a_save_stops_cleanly_and_resumes(reference, tmp_path, monkeypatch):
    ref_run, ops = reference
    at = _first(ops, "write", "step-00000008.tmp-")
    run, proc = _faulty_run(tmp_path, monkeypatch, f"enospc@{at}")
    # No option lets training go on past a failed save: it stops, non-zero, and says why.
    assert proc.returncode != 0 and "No space left on device" in proc.stderr, proc.stderr[-2000:]
    store = _after_fault(run)
    assert not store.incomplete(), "a half-written checkpoint folder was left behind"
    harness("train", str(TINY), "--run-dir", str(run), check=True)
    assert_same_run(ref_run, run, STEPS)
