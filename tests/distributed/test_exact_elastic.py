"""Exact elastic mode (`parallel.exact_elastic`, harness/parallel/exact.py) with real processes (gloo,
torchrun), dropout on: one process accumulating the step's 4 micro-batches ends bit for bit where
two ranks of 2 (and four of 1) end, and a run killed at world size 2, resumed at 1, killed, resumed at 2 ends bit
for bit where the uninterrupted run at 2 ends (docs/distributed.md, "Exact elastic"). Without the
mode both differ (the masks and the sum order follow the world size): `exact_elastic = false`
fails every assertion below."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.checkpoint import CheckpointStore
from harness.checkpoint.diff import compare_checkpoints
from launch import Ranks, run, tail
from procs import ROOT, events, harness

EXACT = ROOT / "tests" / "data" / "exact.toml"  # elastic.toml + exact_elastic, cpu_threads 1, 8 steps


def _losses(run_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def _bitwise_differences(a: Path, b: Path, step: int) -> list[str]:
    """What differs between the two runs' checkpoints of `step` (model and optimizer compared
    whole where FSDP sharded them), besides the files of a rank one run did not have (rank 1's
    data cursor and streams; rank 0's are compared) and the fingerprints' hashes of the model and
    optimizer, which under FSDP cover rank 0's shard, not the whole (docs/distributed.md)."""
    store_a, store_b = CheckpointStore(str(a)), CheckpointStore(str(b))
    diff = compare_checkpoints((store_a, store_a.ref(step)), (store_b, store_b.ref(step)))
    return [d.line for d in diff.differences if not d.part.startswith("rank-") and not _shard_hash(d.where)]


def _shard_hash(where: str) -> bool:
    return where.startswith("parts/fingerprints/") and "state_hash" in where and where.rsplit("/", 1)[-1] in (
        "model", "optim")


@pytest.mark.parametrize("arm, world, strategy", [("adamw", 2, "ddp"), ("muon", 2, "ddp"), ("adamw", 4, "ddp"),
                                                   ("adamw", 2, "fsdp"), ("muon", 2, "fsdp")])
def test_one_process_with_accumulation_is_bitwise_several_ranks(tmp_path, arm, world, strategy):
    """World size 1 (4 micro-batches accumulated) against world size 2 (2 each) and 4 (1 each),
    DDP and FSDP, 4 steps: every logged loss and the final checkpoint (model, optimizer, RNG,
    counters) bitwise equal."""
    sets = ["--set", f"optim.type={arm}", "--set", "train.steps=4", "--set", "debug.step_sleep_s=0",
            "--set", f"parallel.strategy={strategy}"]
    one, many = tmp_path / "one", tmp_path / "many"
    proc = harness("train", str(EXACT), "--run-dir", str(one), *sets, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    log = tmp_path / "many.log"
    assert run(Ranks(("train", str(EXACT), "--run-dir", str(many), *sets), world), log) == 0, tail(log)
    assert ("model sharded with FSDP2" in log.read_text()) == (strategy == "fsdp")
    assert _losses(one) == _losses(many) and sorted(_losses(one)) == [1, 2, 3, 4]
    assert _bitwise_differences(one, many, 4) == []


@pytest.mark.parametrize("arm, strategy", [("adamw", "ddp"), ("adamw", "fsdp"), ("muon", "fsdp")])
def test_killed_at_2_resumed_at_1_killed_resumed_at_2_is_bitwise_the_continuous_run(tmp_path, arm, strategy):
    """`harness verify-resume --world-sizes 2,1,2`: B is SIGKILLed (torchrun and both ranks) after
    step 3, resumed by one process from step 2, SIGKILLed after step 6, resumed at 2 from step 4:
    `identical`, and, from the run dirs themselves, every loss and the final checkpoint bitwise
    equal to A's, with no resume_mismatch (the re-run steps are checked in full in exact mode, but
    for the hashes of resharded parts). Under FSDP the one process trains the whole model, loading
    the shards of step 2 and writing an unsharded step 4, which FSDP at 2 reshards again."""
    work = tmp_path / "work"
    proc = harness("verify-resume", str(EXACT), "--world-sizes", "2,1,2", "--interrupt-at", "3,6",
                   "--work-dir", str(work), "--set", f"parallel.strategy={strategy}", "--set", f"optim.type={arm}",
                   timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert proc.stdout.splitlines()[1].startswith("identical: world size 2 -> 1 -> 2"), proc.stdout
    continuous, elastic = work / "continuous", work / "interrupted"
    assert _losses(continuous) == _losses(elastic) and sorted(_losses(elastic)) == list(range(1, 9))
    assert _bitwise_differences(continuous, elastic, 8) == []
    changes = [(e["old_world_size"], e["new_world_size"]) for e in events(elastic, "world_size_changed")]
    assert changes == [(2, 1), (1, 2)]
    assert not events(elastic, "resume_mismatch")


def test_a_rollback_decided_at_two_ranks_is_the_one_process_s_bit_for_bit(tmp_path):
    """A NaN loss at step 3 (`debug.nan_at_steps`, on rank 0's micro-batches) with
    `train.on_anomaly = "rollback"`: one process and two ranks both roll back to step 2, skip the
    same batch and end with the same losses and the same checkpoint, bit for bit."""
    sets = ["--set", "train.steps=6", "--set", "debug.step_sleep_s=0", "--set", "debug.nan_at_steps=[3]",
            "--set", "train.on_anomaly=rollback"]
    one, two = tmp_path / "one", tmp_path / "two"
    proc = harness("train", str(EXACT), "--run-dir", str(one), *sets, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    log = tmp_path / "two.log"
    assert run(Ranks(("train", str(EXACT), "--run-dir", str(two), *sets)), log) == 0, tail(log)
    for run_dir in (one, two):
        assert [e["step"] for e in events(run_dir, "anomaly")] == [3], events(run_dir)
    assert _losses(one) == _losses(two) and sorted(_losses(one)) == list(range(1, 7))
    assert _bitwise_differences(one, two, 6) == []
