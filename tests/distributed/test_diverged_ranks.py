"""A poisoned state on one rank stops every rank before the save: two `harness train` processes
in one gloo process group, started directly (torchrun would kill the second rank as soon as the
first exits, before it could say why)."""

import subprocess

from launch import free_port
from procs import ENV, TINY, popen


def test_nan_state_on_one_rank_stops_both_before_the_save(tmp_path):
    """Rank 1's running statistic becomes inf in the last forward of step 8 (DDP broadcasts rank
    0's buffers at each forward, so nothing repairs it before the save): at the step-8 save the
    ranks agree, both stop with exit 2, rank 0 without a NaN of its own; step 4 stays the newest."""
    run_dir = tmp_path / "run"
    port = str(free_port())
    args = ["train", str(TINY), "--run-dir", str(run_dir), "--set",
            'model.factory="tests.user_models:overflowing_stat_gpt"', "--set", "model.args.overflow_at_forward=16",
            "--set", "model.args.overflow_rank=1"]
    ranks = [popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                   env={**ENV, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": port})
             for r in (0, 1)]
    out = [p.communicate(timeout=300)[1] for p in ranks]
    assert [p.returncode for p in ranks] == [2, 2], out
    assert "error: a tensor on another rank holds NaN/inf after step 8" in out[0], out[0]
    assert "error: model/logit_sq holds NaN/inf after step 8" in out[1], out[1]
    assert all("Traceback" not in o for o in out), out
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-00000004"]
