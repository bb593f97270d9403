"""Exact elastic mode (`parallel.exact_elastic`, harness/parallel/exact.py) with real processes (gloo,
torchrun), dropout on: one process accumulating the step's 4 micro-batches ends bit for bit where
two ranks of 2 (and four of 1) end, and a run killed at world size 2, resumed at 1, killed, resumed at 2 ends bit
for bit where the uninterrupted run at 2 ends (docs/distributed.md, "Exact elastic"). Without the
mode both differ (the masks and the sum order follow the world size): `exact_elastic = false`
fails every assertion below. A model whose forward updates buffers (batch-norm statistics) trains
without the mode, by name, and its resume at another world size warns, truly; a resume in the
mode says it continues bit for bit, truly."""

from __future__ import annotations

import pytest

from compare import bitwise_differences, losses_of
from launch import Ranks, run, tail
from procs import ROOT, assert_one_line_error, events, harness

EXACT = ROOT / "tests" / "data" / "exact.toml"  # elastic.toml + exact_elastic, cpu_threads 1, 8 steps
TASKS = ROOT / "tests" / "task" / "tasks.toml"  # a regression task, V = 2 micro-batches of 8
BATCH_NORM = 'model.factory="tests.user_models:batch_norm_gpt"'
NOT_PROMISED = "bitwise equality with an uninterrupted run is not promised across world sizes"


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


@pytest.mark.parametrize("model, exact", [("built-in", True), (BATCH_NORM, False)])
def test_a_resume_at_another_world_size_says_whether_it_is_bitwise_and_is_so(tmp_path, model, exact):
    """Killed (debug.crash_at_step) at world size 2 after step 3, resumed by one process from
    step 2, against one process uninterrupted, `parallel.exact_elastic = "auto"`. The GPT trains in
    the mode: the resume says it continues bit for bit, and does. The GPT with a BatchNorm1d
    (running mean, variance and batch count, updated by every training forward on each rank
    over its own micro-batches) trains without it, the start events naming those buffers: the
    resume warns that bitwise equality is not promised, and it does not hold. `true` for it is
    refused in one line, before anything is written."""
    sets = ["--set", "parallel.exact_elastic=auto", "--set", "train.steps=4", "--set", "debug.step_sleep_s=0",
            *(["--set", model] if model != "built-in" else [])]
    run_dir, alone = tmp_path / "run", tmp_path / "alone"
    log = tmp_path / "two.log"
    assert run(Ranks(("train", str(EXACT), "--run-dir", str(run_dir), *sets, "--set", "debug.crash_at_step=3")),
               log) != 0
    resumed = harness("train", str(EXACT), "--run-dir", str(run_dir), *sets, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    harness("train", str(EXACT), "--run-dir", str(alone), *sets, check=True, timeout=300)
    starts = events(run_dir, "start")
    assert [(s["world_size"], s["resumed_from"], s["exact_elastic"]) for s in starts] == [(2, None, exact),
                                                                                          (1, 2, exact)]
    if exact:
        assert "continues bit for bit" in resumed.stderr and NOT_PROMISED not in resumed.stderr, resumed.stderr
        assert losses_of(run_dir) == losses_of(alone) and bitwise_differences(run_dir, alone, 4) == []
        return
    assert starts[0]["exact_elastic_why"].startswith("auto: off, the model's forward updates buffers "
                                                     "model.norm.num_batches_tracked, model.norm.running_mean, "
                                                     "model.norm.running_var"), starts[0]
    assert starts[1]["exact_elastic_why"] == "auto: off, the checkpoint resumed from was trained without it (a run " \
                                             "keeps its mode)"
    assert NOT_PROMISED in resumed.stderr and "continues bit for bit" not in resumed.stderr, resumed.stderr
    differences = bitwise_differences(run_dir, alone, 4)  # each rank's statistics over its own micro-batches
    assert any(line.startswith("model.safetensors:norm.running_mean:") for line in differences), differences
    refused = harness("train", str(EXACT), "--run-dir", str(tmp_path / "true"), "--set", model)
    assert_one_line_error(refused, "parallel.exact_elastic = true, but the model's forward updates buffers "
                                   "model.norm.num_batches_tracked, model.norm.running_mean, model.norm.running_var")
    assert not (tmp_path / "true" / "checkpoints").exists() and not (tmp_path / "true" / "metrics.jsonl").exists()


@pytest.mark.parametrize("config, sets", [
    (TASKS, ("--set", 'task.factory="tests.user_tasks:partly_used"', "--set", "optim.weight_decay=0.1")),
    (EXACT, ("--set", 'model.factory="tests.user_models:cached_mask_gpt"', "--set", "parallel.strategy=fsdp",
             "--set", "train.eval_every=1")),
], ids=["partly-used-parameter", "probed-buffers-fsdp"])
def test_one_process_and_two_ranks_agree_bit_for_bit(tmp_path, config, sets):
    """A parameter only the last micro-batch of even steps uses (rank 1's at world size 2; none on
    odd steps): every rank leaves its gradient None or not alike, so the optimizer steps it on the
    same steps as one process does. A model with a buffer its forward rebuilds (a cached mask):
    exact mode stays on, and its probe forward under FSDP at two ranks changes nothing; evaluated
    after every step, also after the steps no save follows (a forward without a backward leaves
    FSDP's root unsharded: sharding.reshard). Both 4 steps, every loss and the final checkpoint
    bitwise equal."""
    args = ("train", str(config), *sets, "--set", "train.steps=4", "--set", "debug.step_sleep_s=0")
    one, two = tmp_path / "one", tmp_path / "two"
    harness(*args, "--run-dir", str(one), check=True, timeout=300)
    log = tmp_path / "two.log"
    assert run(Ranks((*args, "--run-dir", str(two))), log) == 0, tail(log)
    assert [e["exact_elastic"] for run_dir in (one, two) for e in events(run_dir, "start")] == [True, True]
    assert losses_of(one) == losses_of(two) and sorted(losses_of(one)) == [1, 2, 3, 4]
    assert bitwise_differences(one, two, 4) == []
