"""Every config key is used or refused (harness/config/effects.py): a key that takes effect only
beside another setting, set where it would be ignored, is refused when the config is read, in one
line naming it, where it was set and why; set where it takes effect, or at its default, it loads.

Each rule of ONLY_WITH is checked here in both directions, so a new rule needs its two modes below
(the test that lists them fails until it has them)."""

from __future__ import annotations

from typing import Any, Literal, get_args, get_origin

import pytest

from harness.config import RunConfig, load_config
from harness.config.effects import ONLY_WITH, OnlyWith
from harness.config.toml_text import value_text
from harness.errors import UserError
from procs import TINY, assert_one_line_error, harness

# Per rule (by its first key): settings under which its keys are ignored, and under which they act.
IGNORED = {
    "model.factory": ['task.factory="my_task:build"'],
    "data.eval_fraction": ['data.factory="my_data:build"'],
    "checkpoint.staging_mib": ["checkpoint.async_save=false"],
    "checkpoint.save_deadline_s": ["checkpoint.async_save=false"],
    "health.hang_factor": ["health.hang_watchdog=false"],
    "debug.persist_delay_s": ["checkpoint.async_save=false"],
}
USED = {
    "model.factory": [],
    "task.args": ['task.factory="my_task:build"'],
    "data.args": ['data.factory="my_data:build"'],
    "data.hash_check": ['data.sources=[{url = "shards"}]'],
    "data.eval_fraction": [],
    "data.storage_options": ['data.url="s3://bucket/text"'],
    "train.spike_window": ["train.spike_threshold=6"],
    "train.rollback_skip": ['train.on_anomaly="rollback"'],
    "checkpoint.mtbf_hours": ['checkpoint.every_steps="auto"'],
    "checkpoint.staging_mib": [],
    "checkpoint.save_deadline_s": ['checkpoint.local_dir="/tmp/staged"'],
    "parallel.shard_modules": ['parallel.strategy="fsdp"'],
    "health.hang_factor": [],
    "log.wandb_mode": ['log.trackers=["wandb"]'],
    "log.mlflow_tracking_uri": ['log.trackers=["mlflow"]'],
    "debug.crash_mode": ["debug.crash_at_step=3"],
    "debug.fail_save_step": ["debug.fail_save_rank=1"],
    "debug.hang_in": ["debug.hang_at_step=3"],
    "debug.nan_rank": ["debug.spike_at_steps=[3]"],
    "debug.persist_delay_s": ['checkpoint.local={dir = "/tmp/local", every_steps = 2}'],
}
# Values the generic choice (`other_value`) cannot make: keys that need a partner or a form.
VALUES = {
    "data.eval_sources": ['data.sources=[{url = "a"}]', 'data.eval_sources=[{url = "b"}]'],
    "data.sources": ['data.sources=[{url = "a"}]'],
    "model.factory": ['model.factory="my_model:build"'],
    "data.factory": ['data.factory="my_data:build"'],
    "data.url": ['data.url="corpus.txt"'],
    "parallel.shard_modules": ['parallel.shard_modules="blocks"'],
    "log.mlflow_tracking_uri": ['log.mlflow_tracking_uri="http://mlflow:5000"'],
}

CASES = [(rule, key) for rule in ONLY_WITH for key in rule.keys]


def settings(key: str) -> list[str]:
    return VALUES.get(key) or [f"{key}={value_text(other_value(key))}"]


def other_value(key: str) -> Any:
    """A valid value of `key` other than its default."""
    section, leaf = key.split(".")
    field = type(getattr(RunConfig(), section)).model_fields[leaf]
    default = field.get_default(call_default_factory=True)
    kind = field.annotation
    if get_origin(kind) is Literal:
        return next(v for v in get_args(kind) if v != default)
    if kind is bool:
        return not default
    if isinstance(default, int):
        return default + 1
    if isinstance(default, float):
        return default * 1.5 or 1.0
    if isinstance(default, str):
        return default + "-2"
    if isinstance(default, dict):
        return {"endpoint_url": "http://127.0.0.1:9"}
    if default is None:
        return 64 if "mib" in leaf else 2
    raise AssertionError(f"no other value for {key}: add it to VALUES")


def load(tmp_path, *sets: str):
    config = tmp_path / "run.toml"
    config.write_text('run_dir = "runs/effects"\n')
    return load_config(config, list(sets))


def test_every_rule_has_its_two_modes_here():
    missing = [rule.keys[0] for rule in ONLY_WITH if rule.keys[0] not in USED]
    assert not missing, f"add the settings under which these keys act to USED (and, unless the defaults ignore " \
                        f"them, to IGNORED): {missing}"


@pytest.mark.parametrize("rule, key", CASES, ids=[key for _, key in CASES])
def test_a_key_set_where_it_is_ignored_is_refused_naming_it(tmp_path, rule: OnlyWith, key: str):
    with pytest.raises(UserError) as refused:
        load(tmp_path, *IGNORED.get(rule.keys[0], []), *settings(key))
    message = str(refused.value)
    assert "\n" not in message and f"command line: {key} = " in message, message
    assert f"takes effect only {rule.only}, but " in message and "remove it" in message, message


@pytest.mark.parametrize("key", sorted({key for _, key in CASES}))
def test_the_same_key_where_it_takes_effect_loads(tmp_path, key: str):
    """Under the settings of every rule that names it (model.args: the built-in model's rule)."""
    load(tmp_path, *[s for rule in ONLY_WITH if key in rule.keys for s in USED[rule.keys[0]]], *settings(key))


@pytest.mark.parametrize("rule", ONLY_WITH, ids=[rule.keys[0] for rule in ONLY_WITH])
def test_a_key_at_its_default_is_no_setting_and_loads_anywhere(tmp_path, rule: OnlyWith):
    defaults = RunConfig().model_dump(mode="json")
    at_default = [f"{k}={value_text(defaults[k.split('.')[0]][k.split('.')[1]])}" for k in rule.keys
                  if defaults[k.split(".")[0]][k.split(".")[1]] is not None]
    load(tmp_path, *IGNORED.get(rule.keys[0], []), *at_default)


def test_the_refusal_names_the_file_that_set_the_key(tmp_path):
    base = tmp_path / "base.toml"
    base.write_text("[train]\nspike_window = 50\n")
    (tmp_path / "run.toml").write_text('extends = "base.toml"\n[log]\nwandb_project = "mine"\n')
    with pytest.raises(UserError) as refused:
        load_config(tmp_path / "run.toml")
    assert str(refused.value) == (
        f"{base}: train.spike_window = 50 takes effect only with train.spike_threshold set (spikes are checked only "
        "then), but train.spike_threshold is unset: remove it, or set train.spike_threshold; "
        f'{tmp_path / "run.toml"}: log.wandb_project = "mine" takes effect only with "wandb" in log.trackers, but '
        'log.trackers = []: remove it, or add "wandb" to log.trackers')


def test_harness_train_refuses_an_ignored_key_in_one_line_before_writing_anything(tmp_path):
    run = tmp_path / "run"
    proc = harness("train", str(TINY), "--run-dir", str(run), "--set", "checkpoint.async_save=false",
                   "--set", 'checkpoint.when_busy="skip"')
    assert_one_line_error(proc, 'command line: checkpoint.when_busy = "skip" takes effect only with '
                                "checkpoint.async_save = true (background saves), but checkpoint.async_save = false")
    assert not run.exists()
