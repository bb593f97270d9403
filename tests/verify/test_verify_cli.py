"""`harness verify-resume` with real `harness train` processes and real signals (the runner is
called in-process; the runs it compares are subprocesses)."""

from __future__ import annotations

import re
from pathlib import Path

from harness.cli import main

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "tests" / "data" / "tiny.toml")


def test_kill_and_resume_is_identical(capsys, tmp_path):
    code = main(["verify-resume", TINY, "--interrupt-at", "6", "--signal", "KILL", "--work-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "resumed from 4 -> finished (exit 0)" in out  # KILL: back to the last checkpoint, steps re-run
    assert out.strip().splitlines()[-1].startswith("identical: 12 steps, interrupted at 6")


def test_unsaved_generator_in_the_model_is_found(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent))
    code = main(["verify-resume", TINY, "--interrupt-at", "6", "--signal", "KILL", "--work-dir", str(tmp_path),
                 "--set", 'model.factory="faulty_models:noisy_gpt"', "--set", 'train.unregistered_state="warn"'])
    out = capsys.readouterr().out
    assert code == 1, out
    assert re.search(r"diverged at step 5: part rng\b.*hint: .*dropout", out), out
    # Steps 5 and 6 were logged before the kill: the resumed process compared its re-run at once.
    assert "B's resumed process reported at step 5: loss" in out
