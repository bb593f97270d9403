"""`harness verify-resume` with real `harness train` processes and real signals (the runner is
called in-process; the runs it compares are subprocesses)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from harness.cli import main, verify_resume
from harness.verify.resume_equivalence import Verdict
from procs import events

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "tests" / "data" / "tiny.toml")


def test_kill_and_resume_is_identical(capsys, tmp_path):
    code = main(["verify-resume", TINY, "--interrupt-at", "6", "--signal", "KILL", "--work-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "resumed from 4 -> finished (exit 0)" in out  # KILL: back to the last checkpoint, steps re-run
    # Where the kill landed, as the resumed process found it (the last step the killed one logged);
    # the run keeps training between step 6 being logged and the signal arriving.
    starts = [e for e in events(tmp_path / "interrupted") if e["event"] == "start"]
    landed = starts[1]["previous_reached"]
    assert landed >= 6 and f"SIGKILL landed at step {landed} (planned 6" in out
    planned = "" if landed == 6 else " (planned 6)"
    assert out.strip().splitlines()[-1].startswith(f"identical: 12 steps, interrupted at {landed}{planned};")
    # One run after the other: two default-threaded runs side by side spend their CPU spinning.
    a_exit = [e for e in events(tmp_path / "continuous") if e["event"] == "exit"][-1]
    assert starts[0]["time"] > a_exit["time"], (a_exit, starts[0])


def test_unsaved_generator_in_the_model_is_found(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent))
    code = main(["verify-resume", TINY, "--interrupt-at", "6", "--signal", "KILL", "--work-dir", str(tmp_path),
                 "--set", 'model.factory="faulty_models:noisy_gpt"', "--set", 'train.unregistered_state="warn"'])
    out = capsys.readouterr().out
    assert code == 1, out
    assert re.search(r"diverged at step 5: part rng\b.*hint: .*dropout", out), out
    # Steps 5 and 6 were logged before the kill: the resumed process compared its re-run at once.
    assert "B's resumed process reported at step 5: loss" in out


def test_user_mistakes_are_one_line_errors_before_anything_runs(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(verify_resume, "run_pair", lambda *a: pytest.fail("nothing may run"))
    with pytest.raises(SystemExit) as exit_:  # 0 is not "the config's own step count"
        main(["verify-resume", TINY, "--steps", "0", "--interrupt-at", "6"])
    assert exit_.value.code == 2 and "argument --steps: '0': expected a whole number >= 1" in capsys.readouterr().err
    afile = tmp_path / "afile"
    afile.write_text("")
    assert main(["verify-resume", TINY, "--interrupt-at", "6", "--work-dir", str(afile)]) == 2
    err = capsys.readouterr().err
    assert err == f"error: --work-dir {afile} is a file, not a folder: give a folder path\n", err
    # tiny.toml saves every 4 steps: an interruption at 2 would resume from nothing and test nothing.
    assert main(["verify-resume", TINY, "--interrupt-at", "2,6", "--work-dir", str(tmp_path / "w")]) == 2
    err = capsys.readouterr().err
    assert "step 2 is before the first checkpoint (step 4" in err and err.count("\n") == 1, err
    assert main(["verify-resume", TINY, "--set", "checkpoint.every_steps=0", "--interrupt-at", "6"]) == 2
    assert "only the final step is saved" in capsys.readouterr().err
    assert not (tmp_path / "w").exists()


def test_random_interruptions_come_after_the_first_checkpoint(capsys, monkeypatch):
    seen = []
    monkeypatch.setattr(verify_resume, "run_pair", lambda config, steps, work, sets, points, sig, popen:
                        seen.append(points) or Verdict(identical=True, steps=steps, interrupt_at=points))
    for seed in range(20):
        assert main(["verify-resume", TINY, "--random", "3", "--seed", str(seed)]) == 0
    assert all(4 < p < 12 for points in seen for p in points), seen
    assert main(["verify-resume", TINY, "--random", "8", "--seed", "1"]) == 2
    assert "choose between 1 and 7 interruptions" in capsys.readouterr().err
    # Time-based checkpoints only: a restart that resumed from nothing tested nothing.
    verdict = Verdict(identical=True, steps=12, interrupt_at=[2], not_resumed=[2])
    assert not verdict and str(verdict).startswith("not exercised: B restarted from nothing")
