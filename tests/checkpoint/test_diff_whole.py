"""`compare_checkpoints` on constructed checkpoints: the same model and optimizer state written
sharded (through DCP, as FSDP writes it) and unsharded (as DDP or one process writes it)
compares equal tensor by tensor, whole, and a changed or missing tensor is found with its
deviation; `harness ckpt diff` says the same. verify-resume --world-sizes relies on it to
compare an FSDP run with one that ended at another world size (tests/distributed/test_elastic.py
runs it on real FSDP shards)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from harness.checkpoint import CheckpointStore
from harness.checkpoint.diff import compare_checkpoints
from harness.checkpoint.format import capture
from harness.checkpoint.save.group_commit import GroupCommit
from harness.cli import main

NUMERIC = ("model", "optim")


@pytest.fixture
def one_rank_group(tmp_path):
    """A gloo process group of one rank: DCP's sharded save (GroupCommit) runs in a group."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _parts(delta: float = 0.0, drop: str | None = None) -> dict:
    g = torch.Generator().manual_seed(0)
    model = {"blocks.0.w": torch.randn(6, 4, generator=g), "head.b": torch.randn(3, generator=g)}
    model["blocks.0.w"][2, 1] += delta
    if drop:
        del model[drop]
    optim = {"adamw": {"state": {name: {"exp_avg": t * 0.5, "step": torch.tensor(7.0)} for name, t in model.items()},
                       "param_groups": [{"lr": 1e-3}]}}
    return {"model": model, "optim": optim, "sched": {"step": 7}}


def _sharded(run_dir, parts: dict):
    store = CheckpointStore(str(run_dir))
    return store, GroupCommit(store)(7, capture(parts, sharded=NUMERIC))


def _unsharded(run_dir, parts: dict):
    store = CheckpointStore(str(run_dir))
    return store, store.save(7, parts)


def test_sharded_and_unsharded_checkpoints_of_one_state_are_equal_whole(one_rank_group, tmp_path, capsys):
    sharded, plain = _sharded(tmp_path / "fsdp", _parts()), _unsharded(tmp_path / "ddp", _parts())
    names = {f.name for f in sharded[0].manifest(sharded[1]).files}
    assert {"shards-00000.safetensors", "dcp-metadata.json"} <= names and "model.safetensors" not in names
    # File by file the layouts differ; the sharded parts are compared whole, where they are one state.
    assert compare_checkpoints(sharded, plain).equal
    capsys.readouterr()
    assert main(["ckpt", "diff", sharded[1].path, plain[1].path]) == 0
    assert capsys.readouterr().out.splitlines() == ["note: meta differs (not compared further)", "bitwise equal"]


def test_a_changed_or_missing_tensor_is_found_whole(one_rank_group, tmp_path, capsys):
    sharded = _sharded(tmp_path / "fsdp", _parts())
    changed_at = _unsharded(tmp_path / "changed", _parts(delta=0.25))
    changed = compare_checkpoints(sharded, changed_at)
    by_where = {d.where: d for d in changed.differences}
    assert by_where["model (whole):blocks.0.w"].max_abs == pytest.approx(0.25)
    assert by_where["optim (whole):adamw/state/blocks.0.w/exp_avg"].max_abs == pytest.approx(0.125)
    assert {d.part for d in changed.differences} == {"model", "optim"}
    missing = compare_checkpoints(sharded, _unsharded(tmp_path / "missing", _parts(drop="head.b")))
    lines = [d.line for d in missing.differences if d.part == "model"]
    assert lines == ["parts/model/head.b: only in A", "model (whole):head.b: only in A"], missing.lines

    # `harness ckpt diff` names the tensors and their deviation, not the files of two layouts.
    capsys.readouterr()
    assert main(["ckpt", "diff", sharded[1].path, changed_at[1].path]) == 1
    out = capsys.readouterr().out
    assert "model (whole):blocks.0.w: 1/24 elements differ, max abs difference 0.25, first at [2, 1]" in out, out
    assert "only in" not in out and out.endswith("checkpoints differ\n"), out
