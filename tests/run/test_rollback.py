"""`train.on_anomaly = "rollback"` with real processes: a NaN injected into the batch of step 7
(debug.nan_at_steps) makes the run go back to checkpoint 4, skip that batch and finish; the same
run SIGKILLed after the rollback (before and after the next checkpoint) ends bitwise equal; the
rollback cap stops a run naming the steps; two ranks agree on the rollback."""

import sys
from pathlib import Path

from procs import TINY, assert_one_line_error, assert_same_run, events, harness, kill_at_step, losses

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))

from launch import run as run_launcher, tail, train_args  # noqa: E402

ROLLBACK = ["--set", 'train.on_anomaly="rollback"', "--set", "debug.nan_at_steps=[7]"]


def rollbacks(run_dir) -> list[dict]:
    return [e for e in events(run_dir) if e["event"] == "anomaly"]


def test_a_nan_batch_is_rolled_back_and_skipped_and_a_killed_run_ends_bitwise_equal(tmp_path):
    cont, intr = tmp_path / "continuous", tmp_path / "interrupted"
    harness("train", str(TINY), "--run-dir", str(cont), *ROLLBACK, check=True)
    (rollback,) = rollbacks(cont)
    assert {k: rollback[k] for k in ("action", "step", "batch", "cause", "value", "to_step", "skip")} == {
        "action": "rollback", "step": 7, "batch": 7, "cause": "nonfinite_loss", "value": "nan", "to_step": 4,
        "skip": [7]}
    assert sorted(losses(cont)) == list(range(1, 13))  # each step logged once (losses() asserts it)

    args = ["train", str(TINY), "--run-dir", str(intr), *ROLLBACK]
    # Step 7 is logged only after the rollback: killed before checkpoint 8, the resumed process
    # meets the NaN again and rolls back the same way; killed after it, it resumes past it.
    for step in (7, 10):
        assert kill_at_step(args, intr, step) != 0
    harness(*args, check=True)
    assert_same_run(cont, intr, 12)
    assert all(r["skip"] == [7] and r["to_step"] == 4 for r in rollbacks(intr))

    report = harness("report", str(intr), check=True).stdout
    assert "rollbacks: 1 (step 7 -> 4, skipped batch 7)" in report, report


def test_too_many_rollbacks_stop_the_run_naming_the_steps(tmp_path):
    run = tmp_path / "run"
    proc = harness("train", str(TINY), "--run-dir", str(run), "--set", 'train.on_anomaly="rollback"',
                   "--set", "train.max_rollbacks=1", "--set", "debug.nan_at_steps=[7, 9]")
    # Batch 7 skipped, step 8 draws batch 9: the second anomaly in the window is one too many.
    assert_one_line_error(proc, "loss is nan at step 8: anomalies at steps 7, 8 within 1000 steps; "
                                "stopped after 1 rollbacks (train.max_rollbacks = 1)")
    assert [(e["action"], e["step"]) for e in rollbacks(run)] == [("rollback", 7), ("stop", 8)]


def test_a_nan_on_one_rank_rolls_back_every_rank(tmp_path):
    """The NaN is on rank 1 only; the all-reduced loss carries it to rank 0, so both roll back at
    step 7 without a collective of their own and the group finishes."""
    run_dir, log = tmp_path / "run", tmp_path / "torchrun.log"
    assert run_launcher(train_args(run_dir, *ROLLBACK, "--set", "debug.nan_rank=1"), log) == 0, tail(log)
    (rollback,) = rollbacks(run_dir)
    assert (rollback["step"], rollback["to_step"], rollback["skip"]) == (7, 4, [7])
    assert sorted(losses(run_dir)) == list(range(1, 13))


def test_the_rollback_cap_counts_the_rollbacks_of_a_killed_process(tmp_path):
    """The rollback history is checkpointed: killed after the rollback at step 7 and checkpoint 8,
    the resumed process stops at the second anomaly (step 10, batch 11) as the uninterrupted
    run does, instead of rolling back once more."""
    run = tmp_path / "run"
    args = ["train", str(TINY), "--run-dir", str(run), "--set", 'train.on_anomaly="rollback"',
            "--set", "train.max_rollbacks=1", "--set", "debug.nan_at_steps=[7, 11]",
            "--set", "checkpoint.async_save=false"]  # checkpoint 8 committed before the kill after step 9
    assert kill_at_step(args, run, 9) != 0
    assert_one_line_error(harness(*args), "loss is nan at step 10: anomalies at steps 7, 10 within 1000 steps")


def test_a_loss_spike_is_rolled_back_the_same_way_after_a_kill(tmp_path):
    """With spike detection on, the spike window is checkpointed: killed after checkpoint 8 and
    resumed, the run calls the spike of step 10 as the uninterrupted one does (with only the
    losses seen since the resume it would be too few to call any) and ends bitwise equal."""
    spike = ["--set", 'train.on_anomaly="rollback"', "--set", "train.spike_threshold=6", "--set",
             "train.spike_window=8", "--set", "debug.spike_at_steps=[10]"]
    cont, intr = tmp_path / "continuous", tmp_path / "interrupted"
    harness("train", str(TINY), "--run-dir", str(cont), *spike, check=True)
    (rollback,) = rollbacks(cont)
    assert (rollback["cause"], rollback["step"], rollback["to_step"], rollback["skip"]) == ("loss_spike", 10, 8, [10])
    args = ["train", str(TINY), "--run-dir", str(intr), *spike]
    assert kill_at_step(args, intr, 9) != 0
    harness(*args, check=True)
    assert_same_run(cont, intr, 12)
    assert [r["cause"] for r in rollbacks(intr)] == ["loss_spike"]
