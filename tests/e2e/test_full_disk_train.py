"""`harness train` on a disk that fills up is a one-line error and exit 2, for
synchronous and background saves alike, and says truthfully what is still committed (it claimed
a previous checkpoint when there was none). A real size-limited tmpfs (this machine runs tests as
root; skipped where mounting is not allowed: tests/checkpoint/save/test_async_save.py covers the
background path with the injected ENOSPC everywhere)."""

import pytest

from harness.checkpoint import CheckpointStore
from procs import TINY, assert_one_line_error, harness

KIB = 1024


@pytest.fixture(scope="module")
def checkpoint_kib(tmp_path_factory):
    run = tmp_path_factory.mktemp("size") / "run"
    harness("train", str(TINY), "--run-dir", str(run), "--set", "train.steps=1", check=True)
    return sum(p.stat().st_size for p in (run / "checkpoints").rglob("*") if p.is_file()) // KIB


def train_on(run, logs, async_save):
    return harness("train", str(TINY), "--run-dir", str(run), "--set", f'log_dir="{logs}"',
                   "--set", "train.steps=4", "--set", "checkpoint.every_steps=1",
                   "--set", f"checkpoint.async_save={str(async_save).lower()}")


@pytest.mark.parametrize("async_save", [False, True])
def test_a_full_disk_at_the_first_save_says_nothing_was_committed(tmpfs, tmp_path, checkpoint_kib, async_save):
    mnt = tmpfs(checkpoint_kib // 2)
    proc = train_on(mnt / "run", tmp_path / "logs", async_save)
    assert_one_line_error(proc, "the checkpoint at step 1 could not be written to")
    assert "ENOSPC (No space left on device); free space" in proc.stderr
    assert "no earlier checkpoint of this run exists" in proc.stderr and "newest good one" not in proc.stderr
    assert CheckpointStore(str(mnt / "run")).list() == []
    assert not list((mnt / "run" / "checkpoints").glob("*.tmp-*"))


@pytest.mark.parametrize("async_save", [False, True])
def test_a_full_disk_later_names_the_checkpoint_still_committed(tmpfs, tmp_path, checkpoint_kib, async_save):
    mnt = tmpfs(checkpoint_kib * 3 // 2 + 64)
    proc = train_on(mnt / "run", tmp_path / "logs", async_save)
    assert_one_line_error(proc, "could not be written to")
    assert "the checkpoint at step 1 is still the newest good one" in proc.stderr
    store = CheckpointStore(str(mnt / "run"))
    assert store.latest_good().step == 1 and not list((mnt / "run" / "checkpoints").glob("*.tmp-*"))


def test_full_log_dir_is_one_line(tmpfs, tmp_path):
    mnt = tmpfs(8)
    (mnt / "filler").write_bytes(b"x" * 8 * KIB)  # tmpfs rounds up: the disk is full now
    proc = harness("train", str(TINY), "--run-dir", str(tmp_path / "run"), "--set", f'log_dir="{mnt / "logs"}"',
                   "--set", "train.steps=2")
    assert_one_line_error(proc, "No space left on device")
