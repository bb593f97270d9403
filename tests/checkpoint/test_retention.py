"""retention.py and the store's deletions: exactly which steps survive, and what is cleaned."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from harness.checkpoint import CheckpointError, CheckpointStore
from harness.checkpoint.retention import steps_to_keep

from .conftest import damage


@pytest.mark.parametrize("steps, k, m, kept", [
    ([], 2, 0, set()),
    ([10], 2, 0, {10}),
    ([10, 20, 30, 40, 50], 2, 0, {40, 50}),
    ([10, 20, 30, 40, 50], 3, 0, {30, 40, 50}),
    ([10, 20, 30, 40, 50], 2, 20, {20, 40, 50}),
    ([50, 10, 30, 20, 40], 2, 25, {40, 50}),
    ([100, 150, 200, 250, 300], 2, 100, {100, 200, 250, 300}),
])
def test_keep_last_k_and_every_m(steps, k, m, kept):
    assert steps_to_keep(steps, k, m, max(steps, default=None)) == kept


@pytest.mark.parametrize("k, m", [(1, 0), (0, 0), (3, -1)])
def test_bad_policy_is_refused(k, m):
    with pytest.raises(CheckpointError, match="keep"):
        steps_to_keep([1], k, m, 1)
    with pytest.raises(CheckpointError):
        CheckpointStore("memory://never", keep_last=k, keep_every=m)


def _steps(run_dir: str) -> list[str]:
    return sorted(os.listdir(Path(run_dir) / "checkpoints"))


def test_store_applies_retention_after_each_commit(run_dir):
    store = CheckpointStore(run_dir, keep_last=2, keep_every=4)
    for step in range(1, 10):
        store.save(step, {"p": {"x": step}})
    assert [r.step for r in store.list()] == [4, 8, 9]
    assert _steps(run_dir) == ["step-00000004", "step-00000008", "step-00000009"]


def test_memory_store_retention_removes_manifest_and_data(tmp_path):
    store = CheckpointStore("memory://ret", keep_last=2)
    for step in (1, 2, 3):
        store.save(step, {"p": {"x": step}})
    assert [r.step for r in store.list()] == [2, 3]
    assert not store.loc.fs.exists(f"{store.dir}/step-00000001")
    store.loc.fs.rm(store.loc.root, recursive=True)


def test_leftovers_of_dead_writers_are_cleaned_but_a_live_holders_are_not(run_dir):
    store = CheckpointStore(run_dir, writer_id="me")
    store.save(1, {"p": {"x": 1}})
    ckpts = Path(run_dir) / "checkpoints"
    dead = ckpts / "step-00000002.tmp-crashed-0123abcd"
    half_deleted = ckpts / "step-00000000"
    live = ckpts / "step-00000003.tmp-other-89abcdef"
    for d in (dead, half_deleted, live):
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"x")
    other = CheckpointStore(run_dir, writer_id="other")
    other.acquire_lease()
    removed = store.gc()
    assert sorted(Path(p).name for p in removed) == [half_deleted.name, dead.name]
    assert live.exists()
    other.release_lease()
    store.gc()
    assert _steps(run_dir) == ["step-00000001"]


def test_interrupted_delete_is_not_a_checkpoint(run_dir):
    store = CheckpointStore(run_dir)
    ref = store.save(1, {"p": {"x": 1}})
    store.save(2, {"p": {"x": 2}})
    os.remove(f"{ref.path}/manifest.json")  # what a crash right after "manifest first" leaves
    assert [r.step for r in store.list()] == [2]
    assert store.incomplete() == [ref.path]


def test_with_no_good_checkpoint_nothing_is_deleted_and_the_newest_good_is_always_kept():
    assert steps_to_keep([4, 8, 12], 2, 0, None) == {4, 8, 12}
    assert steps_to_keep([4, 8, 12], 2, 0, 4) == {4, 8, 12}
    assert steps_to_keep([4, 8, 12, 16], 2, 0, 8) == {8, 12, 16}


def test_retention_never_deletes_damaged_checkpoints_while_no_good_one_exists(run_dir):
    """Every checkpoint damaged: `gc` deletes none of them, and a new commit at an older step
    (a run started over with --resume never) keeps itself and the damaged ones."""
    store = CheckpointStore(run_dir, keep_last=2)
    for step in (8, 12, 16):
        damage(store.save(step, {"p": {"x": step}}))  # retention kept 12 and 16
    assert store.gc() == []
    assert [r.step for r in store.list()] == [12, 16]
    store.save(4, {"p": {"x": 4}})
    assert [r.step for r in store.list()] == [4, 12, 16]
    assert store.latest_good().step == 4
