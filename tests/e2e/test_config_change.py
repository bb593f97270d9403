"""`--allow-config-change` with real processes: a changed optimizer hyperparameter takes effect
from the first resumed step, and extending a finished run keeps the lr where the schedule ended."""

import json
import shutil

import pytest

from optim.schedule import Schedule
from procs import TINY, assert_one_line_error, events, harness, losses

SYNC = ["--set", "checkpoint.async_save=false"]  # the step-4 checkpoint is committed before the crash


def lrs(log_dir) -> dict[int, list[float]]:
    """step -> the adamw lrs that step trained with (its metrics line)."""
    lines = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["lr"]["adamw"] for r in lines if "lr" in r}


def test_a_lower_lr_applies_from_the_first_resumed_step(tmp_path):
    base = tmp_path / "base"
    crashed = harness("train", str(TINY), "--run-dir", str(base), *SYNC, "--set", "debug.crash_at_step=6")
    assert crashed.returncode == 13, crashed.stderr[-2000:]
    same, lower = tmp_path / "same", tmp_path / "lower"
    for copy in (same, lower):
        shutil.copytree(base, copy)
    harness("train", str(TINY), "--run-dir", str(same), *SYNC, check=True)
    harness("train", str(TINY), "--run-dir", str(lower), *SYNC, "--set", "optim.lr=1e-4",
            "--allow-config-change", check=True)

    # Resumed from step 4: step 5 starts from the same parameters (same loss) but updates them
    # with the new lr, so every later loss differs.
    a, b = losses(same), losses(lower)
    assert [a[s] for s in range(1, 6)] == [b[s] for s in range(1, 6)]
    assert all(a[s] != b[s] for s in range(6, 13))
    la, lb = lrs(same), lrs(lower)
    assert lb[5] == pytest.approx([1e-4 * Schedule("cosine", 2, 12).multiplier(4)] * 2, rel=1e-12)
    for step in range(5, 13):
        assert lb[step] == pytest.approx([x * 1e-4 / 3e-3 for x in la[step]], rel=1e-12), step
    (change,) = [e for e in events(lower) if e["event"] == "config_changed"]
    assert change["step"] == 4 and change["changes"] == {"optim.lr": {"old": 3e-3, "new": 1e-4}}
    assert change["schedule"] is None
    assert not [e for e in events(lower) if e["event"] == "resume_mismatch"]


def test_extending_a_finished_run_does_not_make_the_lr_jump(tmp_path):
    run = tmp_path / "run"
    harness("train", str(TINY), "--run-dir", str(run), "--set", "train.steps=8", check=True)
    harness("train", str(TINY), "--run-dir", str(run), "--set", "train.steps=12", "--allow-config-change",
            check=True)
    lr = lrs(run)
    assert sorted(losses(run)) == list(range(1, 13))
    # The cosine reached lr_min_ratio (0.1) after step 8, the lr a 9th step would have taken;
    # the 4 added steps train at it.
    assert lr[8] > [3e-4] * len(lr[8])
    assert all(lr[s] == pytest.approx([3e-4] * len(lr[8]), rel=1e-12) for s in range(9, 13))
    (change,) = [e for e in events(run) if e["event"] == "config_changed"]
    assert change["changes"] == {"train.steps": {"old": 8, "new": 12}}
    assert change["schedule"]["from"]["total_steps"] == 8 and change["schedule"]["to"]["total_steps"] == 12
    assert change["schedule"]["anchor"] == {"step": 8, "progress": 1.0}


def test_config_changes_name_old_and_new_values_and_read_old_configs_as_they_ran():
    """A checkpoint's config from before `optim.decay_1d`/`decay_embeddings` existed decayed every
    parameter (the reference's AdamW): resuming it under the new default is a change, not silence."""
    from harness.config import RunConfig, config_changes, load_config, public_config

    cfg = load_config(TINY)
    saved = public_config(cfg)
    assert config_changes(saved, cfg) == {}
    lower = load_config(TINY, ["optim.lr=1e-4", "optim.adam_betas=[0.8, 0.9]"])
    assert config_changes(saved, lower) == {"optim.adam_betas": ([0.9, 0.999], [0.8, 0.9]),
                                            "optim.lr": (3e-3, 1e-4)}
    for key in ("decay_1d", "decay_embeddings"):
        del saved["optim"][key]
    assert config_changes(saved, cfg) == {"optim.decay_1d": (True, False), "optim.decay_embeddings": (True, False)}
    assert config_changes(saved, RunConfig.model_validate(
        {**saved, "optim": {**saved["optim"], "decay_1d": True, "decay_embeddings": True}})) == {}


def test_the_lr_logged_for_a_step_is_the_lr_it_trained_with(tmp_path):
    harness("train", str(TINY), "--run-dir", str(tmp_path / "run"), check=True)
    schedule = Schedule("cosine", warmup=2, total_steps=12)  # tiny.toml's
    assert lrs(tmp_path / "run") == {s: [pytest.approx(3e-3 * schedule.multiplier(s - 1), rel=1e-12)] * 2
                                     for s in range(1, 13)}


def test_a_changed_lr_is_refused_naming_the_old_and_the_new_value(tmp_path):
    run = tmp_path / "run"
    harness("train", str(TINY), "--run-dir", str(run), "--set", "train.steps=4", *SYNC, check=True)
    refused = harness("train", str(TINY), "--run-dir", str(run), "--set", "train.steps=4", "--set", "optim.lr=1e-4")
    assert_one_line_error(refused, "the config changes the math of the run in")
    assert "optim.lr differ from the checkpoint (checkpoint -> now: optim.lr 0.003 -> 0.0001)" in refused.stderr


def test_a_saved_config_keeps_reading_as_it_ran_after_its_arm_lost_the_keys_it_ignored():
    """An sgdm run's config saved while sgdm still accepted (and ignored) AdamW's keys and the
    split's: read back, those keys are dropped, and nothing counts as changed."""
    from harness.config import config_changes, load_config, public_config

    cfg = load_config(TINY, ["optim.type='sgdm'"])
    saved = public_config(cfg)
    saved["optim"].update({"weight_decay": 0.5, "adam_betas": [0.8, 0.9], "decay_1d": True,
                           "decay_embeddings": False, "matrix_patterns": ["blocks.*"]})
    assert config_changes(saved, cfg) == {}
    adamw = public_config(load_config(TINY))
    adamw["optim"]["matrix_patterns"] = ["blocks.*"]
    assert config_changes(adamw, load_config(TINY)) == {}
