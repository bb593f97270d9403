"""Evaluation cadence: every `train.eval_every` steps and once at the end; a last step that is a
multiple of eval_every is evaluated once (metrics.jsonl and TensorBoard), by the final evaluation."""

import json

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from harness.cli import main
from procs import TINY


def test_a_last_step_on_the_eval_cadence_is_evaluated_once(tmp_path):
    run = tmp_path / "run"
    assert main(["train", str(TINY), "--run-dir", str(run), "--set", "train.steps=4", "--set", "train.eval_every=2",
                 "--set", "debug.step_sleep_s=0", "--set", 'log.trackers=["tensorboard"]']) == 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
    assert [step for step, _ in evals] == [2, 4]
    # The final evaluation is the last record.
    assert records[-1] == {**records[-1], "step": 4, "eval_loss": evals[-1][1]}
    board = EventAccumulator(str(run / "tensorboard"))
    board.Reload()
    assert [e.step for e in board.Scalars("eval_loss")] == [2, 4]
