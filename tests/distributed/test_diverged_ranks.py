"""A poisoned state on one rank stops every rank before the save (torchrun, 2 ranks, gloo)."""

from launch import run, tail, train_args


def test_nan_state_on_one_rank_stops_both_before_the_save(tmp_path):
    """Rank 1's running statistic becomes inf in the last forward of step 8 (DDP broadcasts rank
    0's buffers at each forward, so nothing repairs it before the save): at the step-8 save the
    ranks agree, both stop with exit 2, rank 0 without a NaN of its own; step 4 stays the newest."""
    run_dir, log = tmp_path / "run", tmp_path / "torchrun.log"
    code = run(train_args(run_dir, "--set", 'model.factory="tests.user_models:overflowing_stat_gpt"',
                          "--set", "model.args.overflow_at_forward=16", "--set", "model.args.overflow_rank=1"), log)
    text = log.read_text()
    assert code != 0, tail(log)
    assert "error: model/logit_sq holds NaN/inf after step 8" in text, tail(log)
    assert "error: a tensor on another rank holds NaN/inf after step 8" in text, tail(log)
    assert "Traceback" not in text, tail(log)
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-00000004"]
