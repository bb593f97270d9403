"""`harness ckpt ...` through the real entry point: outputs, exit codes, one-line user errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from harness.checkpoint import CheckpointStore
from harness.cli import main
from helpers import flip_byte

from .conftest import folder, torch_state


def run(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()  # drop what the setup logged
    code = main(["ckpt", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture
def two(run_dir):
    store = CheckpointStore(run_dir)
    return store, store.save(1, torch_state(steps=1), meta={"config": {"lr": 0.5}}), store.save(2, torch_state(steps=2))


def test_ls_lists_steps_sizes_and_verification(capsys, run_dir, two):
    _, _, newest = two
    flip_byte(folder(newest) / "model.safetensors", at=-1, mask=0xFF)
    code, out, _ = run(capsys, "ls", run_dir)
    lines = out.splitlines()
    assert code == 0 and len(lines) == 3
    assert lines[1].split()[0] == "1" and "verified" in lines[1] and "KiB" in lines[1]
    assert lines[2].split()[0] == "2" and "BAD" in lines[2] and "model.safetensors: blake3" in lines[2]


def test_ls_and_verify_of_empty_and_missing_run_dirs(capsys, tmp_path):
    (tmp_path / "empty").mkdir()
    assert run(capsys, "ls", str(tmp_path / "empty"))[:2] == (0, f"no checkpoints in {tmp_path / 'empty'}\n")
    assert run(capsys, "verify", str(tmp_path / "empty"))[0] == 1
    code, out, err = run(capsys, "ls", str(tmp_path / "missing"))
    assert code == 2 and err.count("\n") == 1 and "no such run dir" in err
    code, _, err = run(capsys, "verify", "gopher://x/y")
    assert code == 2 and "unknown storage protocol 'gopher'" in err


def test_verify_run_dir_and_single_checkpoint(capsys, run_dir, two):
    _, old, newest = two
    assert run(capsys, "verify", run_dir)[0] == 0
    (folder(newest) / "state.json").write_text("{}")
    code, out, _ = run(capsys, "verify", run_dir)
    assert code == 1 and "FAILED" in out and "state.json: 2 bytes, the manifest says" in out
    assert run(capsys, "verify", old.path)[0] == 0
    assert run(capsys, "verify", newest.path)[0] == 1
    (folder(old) / "manifest.json").unlink()
    code, out, _ = run(capsys, "verify", old.path)
    assert code == 1 and "no manifest.json" in out


def test_show_lists_parts_tensors_and_meta(capsys, two):
    _, old, _ = two
    code, out, _ = run(capsys, "show", old.path)
    assert code == 0
    assert "step 1" in out and "model.safetensors" in out and "state.json" in out
    assert "blocks.0.weight" in out and "bfloat16[4]" in out and "int64[2, 3]" in out and "float32[]" in out
    assert "adamw: " in out and '"lr": 0.5' in out


def test_show_refuses_a_run_dir(capsys, run_dir, two):
    code, _, err = run(capsys, "show", run_dir)
    assert code == 2 and "is a run dir" in err


def test_diff_equal_and_different(capsys, tmp_path):
    a = CheckpointStore(str(tmp_path / "a")).save(3, torch_state(steps=3))
    b = CheckpointStore(str(tmp_path / "b")).save(3, torch_state(steps=3))
    code, out, _ = run(capsys, "diff", a.path, b.path)
    assert (code, out.strip()) == (0, "bitwise equal")
    parts = torch_state(steps=3)
    with torch.no_grad():
        parts["model"].blocks[1].weight[2, 4] += 0.25
    parts["sched"].base_lrs = [0.5]
    c = CheckpointStore(str(tmp_path / "c")).save(4, parts)
    code, out, _ = run(capsys, "diff", a.path, c.path)
    assert code == 1
    assert "note: steps differ: 3 vs 4" in out
    assert "parts/sched/base_lrs/0: A=0.01 B=0.5" in out
    line = next(line for line in out.splitlines() if "blocks.1.weight" in line)
    assert "1/36 elements differ, max abs difference 0.25, first at [2, 4]" in line


def test_diff_counts_nan_payloads_and_negative_zero(capsys, tmp_path):
    a = CheckpointStore(str(tmp_path / "a")).save(1, {"p": {"x": torch.tensor([0.0, float("nan")])}})
    b = CheckpointStore(str(tmp_path / "b")).save(1, {"p": {"x": torch.tensor([-0.0, float("nan")])}})
    code, out, _ = run(capsys, "diff", a.path, b.path)
    assert code == 1 and "1/2 elements differ" in out and "first at [0]" in out


def test_gc_applies_retention_under_the_lease(capsys, run_dir):
    store = CheckpointStore(run_dir, keep_last=10)
    for step in range(1, 6):
        store.save(step, {"p": {"x": step}})
    (Path(run_dir) / "checkpoints" / "step-00000009.tmp-dead-00000000").mkdir()
    holder = CheckpointStore(run_dir, writer_id="trainer")
    holder.acquire_lease()
    code, _, err = run(capsys, "gc", run_dir, "--keep-last", "2")
    assert code == 2 and "leased to writer trainer" in err and "--takeover" in err
    holder.release_lease()
    code, out, _ = run(capsys, "gc", run_dir, "--keep-last", "2")
    assert code == 0 and "4 removed, 2 checkpoint(s) kept" in out
    assert [r.step for r in store.list()] == [4, 5]
    assert not (Path(run_dir) / "lease.json").exists()
    assert run(capsys, "gc", run_dir, "--keep-last", "1")[0] == 2


def test_manifest_with_path_outside_is_reported_by_verify(capsys, run_dir, two):
    _, old, _ = two
    doc = json.loads((folder(old) / "manifest.json").read_text())
    doc["files"][0]["name"] = "../../../etc/passwd"
    (folder(old) / "manifest.json").write_text(json.dumps(doc))
    code, out, _ = run(capsys, "verify", old.path)
    assert code == 1 and "not a plain file name" in out
