"""`harness verify-resume` with real `harness train` processes and real signals (the runner is
called in-process; the runs it compares are subprocesses)."""

from __future__ import annotations

import re
from pathlib import Path

from harness.cli import main
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


def test_unsaved_generator_in_the_model_is_found(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent))
    code = main(["verify-resume", TINY, "--interrupt-at", "6", "--signal", "KILL", "--work-dir", str(tmp_path),
                 "--set", 'model.factory="faulty_models:noisy_gpt"', "--set", 'train.unregistered_state="warn"'])
    out = capsys.readouterr().out
    assert code == 1, out
    assert re.search(r"diverged at step 5: part rng\b.*hint: .*dropout", out), out
    # Steps 5 and 6 were logged before the kill: the resumed process compared its re-run at once.
    assert "B's resumed process reported at step 5: loss" in out
