"""Keys that take effect only beside others: the one table of them (`ONLY_WITH`) and the check
that refuses such a key where it would be ignored (`ignored_keys`, which load_config runs), so
that every key of a config is either used or refused, never dropped in silence.

A rule names its keys, the condition under which they take effect (a predicate on the whole
config, and the same in words for the reference and the error) and what the config does
instead. A key counts as given when its value differs from its default: a key at its default
changes nothing in any mode, and a saved config, dumped whole, names every key. What only a
running process knows (the world size, the device, whether a data factory returns an iterator)
is checked where it is used (harness/run/trainer.py, harness/run/session.py). [optim] is
optim/config.py's: each optim.type takes only its own keys.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from harness.config.run import RunConfig
from harness.config.section import dumped_default
from harness.config.task import LANGUAGE_MODEL_KEYS
from harness.config.toml_text import value_text


@dataclass(frozen=True)
class OnlyWith:
    """`keys` (dotted) take effect only when `applies(cfg)`: `only` says when, in words that
    follow "takes effect only"; `instead(cfg)` what the config does, in words that follow "but";
    `fix`, the other way out besides removing the key (None: removing it is the way)."""

    keys: tuple[str, ...]
    applies: Callable[[RunConfig], bool]
    only: str
    instead: Callable[[RunConfig], str]
    fix: str | None = None


def _data_kind(cfg: RunConfig) -> str:
    """What the run reads instead of token shards from storage, in words that follow "but"."""
    d = cfg.data
    if d.factory is not None:
        return f"the data are data.factory = {value_text(d.factory)}'s"
    if d.sources:
        return "every data.sources entry has storage_options of its own"
    return "the data are the text file data.url" if d.url is not None else "the data are the built-in corpus"


ONLY_WITH: tuple[OnlyWith, ...] = (
    OnlyWith(tuple(f"{section}.{key}" for section, keys in LANGUAGE_MODEL_KEYS.items() for key in keys),
             lambda c: c.task.factory is None, "with the built-in language model (task.factory unset)",
             lambda c: f"task.factory = {value_text(c.task.factory)} builds its own models and data",
             "pass what the task needs in task.args"),
    OnlyWith(("task.args",), lambda c: c.task.factory is not None, "with task.factory (they are its arguments)",
             lambda c: "task.factory is unset (the run trains the built-in language model)", "set task.factory"),
    OnlyWith(("data.args",), lambda c: c.data.factory is not None, "with data.factory (they are its arguments)",
             lambda c: "data.factory is unset", "set data.factory (a model's arguments go in model.args)"),
    OnlyWith(("data.hash_check",), lambda c: bool(c.data.sources), "with data.sources (it checks token shards)",
             _data_kind, "set data.sources"),
    OnlyWith(("data.eval_fraction",), lambda c: c.data.factory is None and not c.data.eval_sources,
             "where evaluation is held out of the training data (no data.factory, no data.eval_sources)",
             lambda c: ("data.factory returns its own eval source" if c.data.factory is not None
                        else "evaluation reads data.eval_sources whole")),
    OnlyWith(("data.storage_options",),
             lambda c: c.data.url is not None or any(not s.storage_options for s in c.data.sources),
             "with data.url, or a data.sources entry without storage_options of its own", _data_kind),
    OnlyWith(("train.spike_window",), lambda c: c.train.spike_threshold is not None,
             "with train.spike_threshold set (spikes are checked only then)",
             lambda c: "train.spike_threshold is unset", "set train.spike_threshold"),
    OnlyWith(("train.rollback_skip", "train.max_rollbacks", "train.rollback_window"),
             lambda c: c.train.on_anomaly == "rollback", 'with train.on_anomaly = "rollback"',
             lambda c: f"train.on_anomaly = {value_text(c.train.on_anomaly)}", 'set train.on_anomaly = "rollback"'),
    OnlyWith(("checkpoint.mtbf_hours",),
             lambda c: c.checkpoint.every_steps == "auto" or (c.checkpoint.local is not None
                                                               and c.checkpoint.local.every_steps == "auto"),
             'with checkpoint.every_steps (or checkpoint.local.every_steps) = "auto"',
             lambda c: "neither cadence is \"auto\"", 'set checkpoint.every_steps = "auto"'),
    OnlyWith(("checkpoint.staging_mib", "checkpoint.when_busy"), lambda c: c.checkpoint.async_save,
             "with checkpoint.async_save = true (background saves)", lambda c: "checkpoint.async_save = false",
             "set checkpoint.async_save = true"),
    OnlyWith(("checkpoint.save_deadline_s",), lambda c: c.checkpoint.async_save or c.checkpoint.local_dir is not None,
             "with checkpoint.async_save = true or checkpoint.local_dir (a save in the background)",
             lambda c: "checkpoint.async_save = false and checkpoint.local_dir is unset",
             "set checkpoint.async_save = true"),
    OnlyWith(("parallel.shard_modules", "parallel.param_dtype"), lambda c: c.parallel.strategy == "fsdp",
             'with parallel.strategy = "fsdp"', lambda c: f"parallel.strategy = {value_text(c.parallel.strategy)}",
             'set parallel.strategy = "fsdp"'),
    OnlyWith(("health.hang_factor", "health.hang_floor_s", "health.first_step_s"),
             lambda c: c.health.hang_watchdog, "with health.hang_watchdog = true",
             lambda c: "health.hang_watchdog = false", "set health.hang_watchdog = true"),
    OnlyWith(("log.wandb_mode", "log.wandb_project"), lambda c: "wandb" in c.log.trackers,
             'with "wandb" in log.trackers', lambda c: f"log.trackers = {value_text(c.log.trackers)}",
             'add "wandb" to log.trackers'),
    OnlyWith(("log.mlflow_tracking_uri", "log.mlflow_experiment"), lambda c: "mlflow" in c.log.trackers,
             'with "mlflow" in log.trackers', lambda c: f"log.trackers = {value_text(c.log.trackers)}",
             'add "mlflow" to log.trackers'),
    OnlyWith(("debug.crash_mode", "debug.crash_once"), lambda c: c.debug.crash_at_step is not None,
             "with debug.crash_at_step set", lambda c: "debug.crash_at_step is unset", "set debug.crash_at_step"),
    OnlyWith(("debug.fail_save_step",), lambda c: c.debug.fail_save_rank is not None,
             "with debug.fail_save_rank set", lambda c: "debug.fail_save_rank is unset", "set debug.fail_save_rank"),
    OnlyWith(("debug.hang_in", "debug.hang_rank"), lambda c: c.debug.hang_at_step is not None,
             "with debug.hang_at_step set", lambda c: "debug.hang_at_step is unset", "set debug.hang_at_step"),
    OnlyWith(("debug.nan_rank",), lambda c: bool(c.debug.nan_at_steps or c.debug.spike_at_steps),
             "with debug.nan_at_steps or debug.spike_at_steps set", lambda c: "both are empty",
             "set debug.nan_at_steps"),
    OnlyWith(("debug.persist_delay_s",), lambda c: c.checkpoint.async_save or c.checkpoint.local is not None,
             "with checkpoint.async_save = true or [checkpoint.local] (a background persist or peer copy)",
             lambda c: "checkpoint.async_save = false and there is no [checkpoint.local]",
             "set checkpoint.async_save = true"),
)


def only_with(key: str) -> list[OnlyWith]:
    """The rules that name dotted `key` (none: the key takes effect in every mode)."""
    return [rule for rule in ONLY_WITH if key in rule.keys]


def ignored_keys(cfg: RunConfig) -> dict[str, str]:
    """Dotted key -> why it would be ignored, for every key `cfg` gives a value other than its
    default where its rule does not apply; in ONLY_WITH's order (the first rule to name a key
    speaks for it)."""
    tree = cfg.model_dump(mode="json")
    problems: dict[str, str] = {}
    for rule in ONLY_WITH:
        if rule.applies(cfg):
            continue
        for key in rule.keys:
            value = _value(tree, key)
            if key not in problems and value != _default(key):
                fix = f", or {rule.fix}" if rule.fix else ""
                problems[key] = (f"{key} = {value_text(value)} takes effect only {rule.only}, but "
                                 f"{rule.instead(cfg)}: remove it{fix}")
    return problems


def _value(tree: dict[str, Any], key: str) -> Any:
    node: Any = tree
    for part in key.split("."):
        node = node[part]
    return node


def _default(key: str) -> Any:
    """The default of dotted `key` (of a section of RunConfig's), as model_dump(mode="json") gives it."""
    *parents, leaf = key.split(".")
    section: Any = RunConfig
    for part in parents:
        section = section.model_fields[part].annotation
    return dumped_default(section.model_fields[leaf])
