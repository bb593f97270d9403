"""A run whose numbers blow up stops before the optimizer step and before any save: exit 2, one
line, and the newest checkpoint is the last good one (real `harness train` processes)."""

import json

import torch
from safetensors.torch import load_file

from procs import TINY, assert_one_line_error, harness


def checkpoint_steps(run) -> list[int]:
    return sorted(int(p.name.removeprefix("step-")) for p in (run / "checkpoints").iterdir())


def logged_steps(run) -> list[int]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return sorted({json.loads(line)["step"] for line in lines if "loss" in json.loads(line)})


def assert_finite_model(run, step: int) -> None:
    tensors = load_file(str(run / "checkpoints" / f"step-{step:08d}" / "model.safetensors"))
    assert all(torch.isfinite(t).all() for t in tensors.values())


def test_nan_gradients_with_a_finite_loss_stop_before_the_step_and_the_save(tmp_path):
    run = tmp_path / "run"
    # grad_accum = 2: training forwards 15 and 16 are step 8, a checkpoint step.
    proc = harness("train", str(TINY), "--run-dir", str(run), "--set", 'model.factory="tests.user_models:nan_grad_gpt"',
                   "--set", "model.args.nan_grad_at_forward=15")
    assert_one_line_error(proc, "gradient norm is nan (loss ")
    assert ") at step 8; the step was not applied and no checkpoint of it was written" in proc.stderr
    assert checkpoint_steps(run) == [4]
    assert logged_steps(run) == list(range(1, 8))
    assert harness("ckpt", "verify", str(run)).returncode == 0
    assert_finite_model(run, 4)


def test_a_state_poisoned_with_finite_loss_and_gradients_is_never_saved(tmp_path):
    """A running statistic (a persistent buffer) overflows to inf at step 6 (training forward
    11), a step that is not checked by its loss or gradient norm: the save check at step 8 stops
    the run, and step 4 stays the newest checkpoint."""
    run = tmp_path / "run"
    proc = harness("train", str(TINY), "--run-dir", str(run), "--set",
                   'model.factory="tests.user_models:overflowing_stat_gpt"',
                   "--set", "model.args.overflow_at_forward=11")
    assert_one_line_error(proc, "model/logit_sq holds NaN/inf after step 8; no checkpoint of this state was written")
    assert checkpoint_steps(run) == [4]
    assert_finite_model(run, 4)
