"""`harness status RUN_DIR` on real runs: one stopped mid-way (what a live one shows), and a finished one with a rollback and a hang."""

import signal
import subprocess
import sys

from procs import ENV, ROOT, TINY, harness, kill_at_step


def test_status_of_a_run_that_stopped_mid_way(tmp_path):
    """What a running run shows; a run whose process is gone shows the same (only a live lease
    could tell them apart), so a killed one is looked at: no race with a run that finishes
    while `harness status` starts on a busy machine."""
    run = tmp_path / "run"
    kill_at_step(["train", str(TINY), "--run-dir", str(run), "--set", "debug.step_sleep_s=0.3"], run, 2)
    live = harness("status", str(run), check=True).stdout
    assert "  step " in live and "/12 (" in live and "running, or killed: last record" in live, live
    assert "tokens/s" in live and "ETA " in live, live


def test_status_of_a_finished_run_with_a_rollback_and_a_hang(tmp_path):
    run = tmp_path / "run"
    harness("train", str(TINY), "--run-dir", str(run), "--max-restarts", "2", "--set", "debug.step_sleep_s=0.3",
            "--set", 'train.on_anomaly="rollback"', "--set", "debug.nan_at_steps=[7]",
            "--set", "health.hang_floor_s=10", "--set", "health.hang_factor=2", "--set", "debug.hang_at_step=10",
            check=True)
    done = harness("status", str(run), check=True).stdout
    lines = done.splitlines()
    assert lines[1] == "  step 12/12 (100.0 %)", done
    assert "  state       stopped: finished" in lines, done
    assert "  checkpoint  step 12, committed " in done, done
    assert "  processes   2, 1 supervisor restart(s); goodput " in done, done
    assert "  anomaly     step 7: nonfinite_loss (nan), rolled back to step 4; 1 rollback(s) in all" in lines, done
    assert any(line.startswith("  hang        step 10 in step (limit ") for line in lines), done


def test_watch_redraws_until_interrupted(tmp_path):
    run = tmp_path / "run"
    harness("train", str(TINY), "--run-dir", str(run), "--set", "train.steps=2", check=True)
    # Ctrl-C as a terminal delivers it: a test runner started in the background (a CI script's
    # `cmd &`) ignores SIGINT, and its children would inherit that.
    watch = subprocess.Popen([sys.executable, "-m", "harness.cli", "status", str(run), "--watch", "0.05"],
                             stdout=subprocess.PIPE, text=True, env=ENV, cwd=ROOT,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    frames = 0
    while frames < 2:
        frames += watch.stdout.readline().count("\033[2J")
    watch.send_signal(signal.SIGINT)
    watch.communicate(timeout=30)
    assert watch.returncode == 0


def test_status_of_a_folder_without_a_run_is_a_one_line_error(tmp_path):
    proc = harness("status", str(tmp_path))
    assert proc.returncode == 2 and proc.stderr.startswith("error: no events file at ") and "Traceback" not in proc.stderr
