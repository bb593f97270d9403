"""`harness ckpt gc` applies the run's own retention policy (run.json), never
removes the newest good checkpoint, lists what it would remove with --dry-run, and is a one-line
error on a read-only run dir."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from harness.checkpoint import CheckpointStore
from harness.cli import main

from .conftest import damage


def gc(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(["ckpt", "gc", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def make_run(run_dir: str, steps, keep_last: int, keep_every: int) -> CheckpointStore:
    """Checkpoints at `steps` (retention off while writing) and a run.json with the policy."""
    store = CheckpointStore(run_dir, keep_last=1000)
    for step in steps:
        store.save(step, {"p": {"x": step}})
    (Path(run_dir) / "run.json").write_text(json.dumps(
        {"run_id": "test", "config": {"checkpoint": {"keep_last": keep_last, "keep_every": keep_every}}}))
    return store


def steps(store: CheckpointStore) -> list[int]:
    return [r.step for r in store.list()]


def test_gc_applies_the_runs_own_policy_by_default(capsys, run_dir):
    store = make_run(run_dir, range(1, 10), keep_last=2, keep_every=4)
    code, out, _ = gc(capsys, run_dir)
    assert code == 0 and steps(store) == [4, 8, 9], out  # the flags' old defaults (3, 0) removed step 4
    assert "keep_last=2, keep_every=4" in out


def test_gc_flags_override_the_runs_policy(capsys, run_dir):
    store = make_run(run_dir, range(1, 6), keep_last=2, keep_every=4)
    assert gc(capsys, run_dir, "--keep-last", "3", "--keep-every", "0")[0] == 0
    assert steps(store) == [3, 4, 5]


def test_gc_never_removes_the_newest_good_checkpoint(capsys, run_dir):
    store = make_run(run_dir, [1, 2, 3], keep_last=2, keep_every=0)
    damage(store.ref(2))
    damage(store.ref(3))
    code, out, _ = gc(capsys, run_dir)
    assert code == 0 and steps(store) == [1, 2, 3], out
    assert "newest good step 1" in out


def test_gc_keeps_every_checkpoint_while_none_verifies(capsys, run_dir):
    store = make_run(run_dir, [1, 2, 3, 4], keep_last=2, keep_every=0)
    for step in (1, 2, 3, 4):
        damage(store.ref(step))
    code, out, _ = gc(capsys, run_dir)
    assert code == 0 and steps(store) == [1, 2, 3, 4] and "no checkpoint" in out and "verifies" in out


def test_gc_dry_run_lists_and_removes_nothing(capsys, run_dir):
    store = make_run(run_dir, range(1, 6), keep_last=2, keep_every=0)
    leftover = Path(run_dir) / "checkpoints" / "step-00000009.tmp-dead-00000000"
    leftover.mkdir()
    code, out, _ = gc(capsys, run_dir, "--dry-run")
    assert code == 0 and steps(store) == [1, 2, 3, 4, 5] and leftover.exists()
    would = sorted(line.split()[-1].rsplit("/", 1)[-1] for line in out.splitlines() if line.startswith("would remove"))
    assert would == ["step-00000001", "step-00000002", "step-00000003", leftover.name]
    assert "4 would remove, 2 checkpoint(s) kept" in out
    assert gc(capsys, run_dir)[0] == 0 and steps(store) == [4, 5] and not leftover.exists()


def test_gc_without_run_json_needs_the_policy(capsys, run_dir):
    CheckpointStore(run_dir).save(1, {"p": {"x": 1}})
    code, _, err = gc(capsys, run_dir)
    assert code == 2 and "no run.json" in err and "--keep-last" in err


@pytest.fixture
def read_only_run(tmpfs):
    mnt = tmpfs(4096)
    make_run(str(mnt / "run"), range(1, 5), keep_last=2, keep_every=0)
    subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
    return str(mnt / "run")


def test_gc_on_a_read_only_run_dir_is_one_line(capsys, read_only_run):
    code, out, err = gc(capsys, read_only_run)
    assert code == 2 and "Traceback" not in err, err
    assert err.startswith("error: cannot remove checkpoints in")
    assert "Read-only file system" in err and "--dry-run" in err
    code, out, _ = gc(capsys, read_only_run, "--dry-run")
    assert code == 0 and "2 would remove" in out
