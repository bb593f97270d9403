"""`harness status RUN_DIR` on real runs: one stopped mid-way (what a live one shows), and a finished one with a
rollback and a hang."""

import os
import pty
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
    harness("train", str(TINY), "--run-dir", str(run), "--max-restarts", "2", "--backoff-initial", "0.1",
            "--set", "debug.step_sleep_s=0.3", "--set", 'train.on_anomaly="rollback"',
            "--set", "debug.nan_at_steps=[7]",
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


def _watch(run, stdout) -> subprocess.Popen:
    # Ctrl-C as a terminal delivers it: a test runner started in the background (a CI script's
    # `cmd &`) ignores SIGINT, and its children would inherit that.
    return subprocess.Popen([sys.executable, "-m", "harness.cli", "status", str(run), "--watch", "0.05"],
                            stdout=stdout, stderr=subprocess.PIPE, text=True, env=ENV, cwd=ROOT,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _interrupt(watch: subprocess.Popen) -> tuple[str | None, str]:
    """Ctrl-C; the rest of its stdout (when a pipe) and stderr. It must end with exit 0."""
    watch.send_signal(signal.SIGINT)
    out, err = watch.communicate(timeout=30)
    assert watch.returncode == 0, err
    return out, err


def test_watch_waits_for_the_run_and_redraws_in_place_only_on_a_terminal(tmp_path):
    run = tmp_path / "run"
    # Into a pipe, started before the run: it waits (saying so once), then prints plain screens.
    piped = _watch(run, subprocess.PIPE)
    assert piped.stderr.readline().startswith(f"waiting for the run to start: no {run / 'events.jsonl'} yet")
    harness("train", str(TINY), "--run-dir", str(run), "--set", "train.steps=2", check=True)
    screens, seen = 0, ""
    while screens < 2:
        line = piped.stdout.readline()
        seen += line
        screens += line.startswith(f"run {run}")
    rest, err = _interrupt(piped)
    assert "waiting" not in err, err  # said once
    assert "\033" not in seen + rest, seen

    # On a terminal: each refresh clears the screen and draws it from the top.
    terminal, port = pty.openpty()
    shown = _watch(run, port)
    os.close(port)
    drawn = b""
    while drawn.count(b"\033[H\033[2J") < 2:
        drawn += os.read(terminal, 4096)
    _interrupt(shown)
    os.close(terminal)
    assert drawn.startswith(b"\033[H\033[2Jrun "), drawn[:80]


def test_status_of_a_folder_without_a_run_is_a_one_line_error(tmp_path):
    proc = harness("status", str(tmp_path))
    assert proc.returncode == 2 and proc.stderr.startswith("error: no events file at ")
    assert "Traceback" not in proc.stderr
