"""Non-persistent buffers and exact resume, with a user's model factory (tests/user_models.py) in
real `harness train` processes: a cache that forward rebuilds raises no alarm; state kept in one
is refused before the first step, and named when the run goes on anyway."""

from __future__ import annotations

from pathlib import Path

from harness.cli import main
from procs import TINY, assert_one_line_error, harness

CACHED_MASK = 'model.factory="tests.user_models:cached_mask_gpt"'
LOSS_EMA = 'model.factory="tests.user_models:loss_ema_gpt"'


def verify_resume(capsys, work: Path, *sets: str) -> tuple[int, str]:
    args = ["verify-resume", str(TINY), "--interrupt-at", "6", "--signal", "KILL", "--work-dir", str(work)]
    code = main([*args, *(x for s in sets for x in ("--set", s))])
    return code, capsys.readouterr().out


def test_a_cache_rebuilt_by_forward_is_no_divergence(capsys, tmp_path):
    code, out = verify_resume(capsys, tmp_path, CACHED_MASK)
    assert code == 0, out
    assert out.strip().splitlines()[-1].startswith("identical: 12 steps")
    assert "reported" not in out  # B's resumed process raised no resume_mismatch


def test_state_in_a_non_persistent_buffer_is_refused_before_the_first_step(tmp_path):
    run = tmp_path / "run"
    proc = harness("train", str(TINY), "--run-dir", str(run), "--set", LOSS_EMA)
    assert_one_line_error(proc, "non-persistent buffers carry state across steps: model.loss_ema (forward reads")
    assert not (run / "checkpoints").exists() or not any((run / "checkpoints").iterdir())


def test_state_in_a_non_persistent_buffer_is_named_when_the_resume_diverges(capsys, tmp_path):
    code, out = verify_resume(capsys, tmp_path, LOSS_EMA, 'train.unregistered_state="warn"')
    assert code == 1, out
    assert "diverged at step 5: part model, tensor model.loss_ema; hint: non-persistent buffer model.loss_ema" in out
