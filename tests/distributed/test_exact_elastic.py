"""Exact elastic mode (`parallel.exact_elastic`, harness/parallel/exact.py) with real processes (gloo,
torchrun), dropout on: one process accumulating the step's 4 micro-batches ends bit for bit where
two ranks of 2 (and four of 1) end, and a run killed at world size 2, resumed at 1, killed, resumed at 2 ends bit
for bit where the uninterrupted run at 2 ends (docs/distributed.md, "Exact elastic"). Without the
mode both differ (the masks and the sum order follow the world size): `exact_elastic = false`
fails every assertion below."""

from __future__ import annotations

import pytest

from compare import bitwise_differences, losses_of
from launch import Ranks, run, tail
from procs import ROOT, events, harness

EXACT = ROOT / "tests" / "data" / "exact.toml"  # elastic.toml + exact_elastic, cpu_threads 1, 8 steps


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
    assert losses_of(one) == losses_of(many) and sorted(losses_of(one)) == [1, 2, 3, 4]
    assert bitwise_differences(one, many, 4) == []


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
    assert losses_of(continuous) == losses_of(elastic) and sorted(losses_of(elastic)) == list(range(1, 9))
    assert bitwise_differences(continuous, elastic, 8) == []
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
    assert losses_of(one) == losses_of(two) and sorted(losses_of(one)) == list(range(1, 7))
    assert bitwise_differences(one, two, 6) == []
