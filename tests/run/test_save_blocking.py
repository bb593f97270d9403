"""A save's `blocking_s` (the `checkpoint` and `local_checkpoint` events, the step loop's saving
time, the "auto" interval's input) is all the step loop waits for at a save: the NaN/inf check
before the snapshot included."""

from __future__ import annotations

import time

from harness.config import load_config
from harness.run import session
from harness.run.trainer import Trainer
from procs import TINY, events

CHECK_S = 0.3


def test_the_blocking_of_every_save_counts_the_finite_state_check(tmp_path, monkeypatch):
    real = Trainer.check_finite_state

    def slow_check(self: Trainer) -> None:
        time.sleep(CHECK_S)
        real(self)

    monkeypatch.setattr(Trainer, "check_finite_state", slow_check)
    run = tmp_path / "run"
    overrides = [f"run_dir={str(run)!r}", f"checkpoint.local.dir={str(tmp_path / 'local')!r}",
                 "checkpoint.local.every_steps=2", "checkpoint.every_steps=3", "train.steps=6", "debug.step_sleep_s=0"]
    assert session.train(load_config(TINY, overrides)) == 0
    saves = events(run, "checkpoint") + events(run, "local_checkpoint")
    assert sorted(e["step"] for e in saves) == [2, 3, 4, 6]  # local at 2 and 4, the run dir at 3 and 6
    assert all(e["blocking_s"] >= CHECK_S for e in saves), saves
