"""Which keys decide the numbers a run produces (the math keys) and which may change between
restarts (FREE_FIELDS). A resume with a math key changed is refused unless explicitly allowed;
`config_changes` names them, old against new."""

from __future__ import annotations

import copy
from typing import Any

from harness.config.run import RunConfig, model_args
from harness.config_layers import flatten
from optim.config import IGNORED_BEFORE, arms_taking

# Keys that may change between restarts of one run without changing its numbers. `data.url` is not
# among them (a text file's URL is part of its identity); `data.sources` holds URLs of token shards,
# which may move: what the numbers depend on (each index's sha256 and the weights) is recorded and
# checked as the data identity instead (harness/data/identity.py, harness/data/sources.py).
FREE_FIELDS = ("run_dir", "log_dir", "checkpoint", "health", "log", "debug", "data.num_workers", "data.storage_options",
               "data.sources", "data.eval_sources", "data.hash_check", "train.eval_every", "train.eval_batches",
               "train.log_every", "train.device", "train.cpu_threads", "train.host_heap",
               "train.fingerprint_every", "train.on_divergence", "train.unregistered_state",
               # Anomaly handling changes the numbers only at an anomaly, and what it did then (the
               # skipped batches) is checkpointed state: a resume repeats it under any of these.
               "train.on_anomaly", "train.spike_threshold", "train.spike_window", "train.rollback_skip",
               "train.max_rollbacks", "train.rollback_window",
               # Like the world size: the sum order of the gradient reduction, nothing else (a
               # sharded checkpoint loads into DDP or one process and back).
               "parallel.strategy", "parallel.shard_modules")


def math_fields(cfg: RunConfig) -> dict[str, Any]:
    """Flatten the config to dotted keys, leaving out FREE_FIELDS: what a resume must keep."""
    tree = cfg.model_dump(mode="json")
    tree["model"]["args"] = model_args(cfg)
    flat = flatten(tree)
    return {k: v for k, v in flat.items() if not is_free(k)}


def is_free(key: str) -> bool:
    """Whether dotted config `key` is (inside) one of FREE_FIELDS: it does not change the numbers."""
    return any(key == f or key.startswith(f + ".") for f in FREE_FIELDS)


# [optim] keys added after runs existed whose default is not what those runs did: a saved config
# without the key ran with this value (the reference's AdamW decayed every parameter).
ADDED_OPTIM_KEYS = {"decay_1d": True, "decay_embeddings": True}


def as_it_ran(saved: dict[str, Any]) -> dict[str, Any]:
    """A saved config read as the run it records ran: each `ADDED_OPTIM_KEYS` key its optimizer
    arm takes set to what the run did, the keys its arm ignored then (`IGNORED_BEFORE`) dropped."""
    saved = copy.deepcopy(saved)
    optim = saved.get("optim")
    if not isinstance(optim, dict):
        return saved
    arm = optim.get("type", "adamw")
    for key in IGNORED_BEFORE.get(arm, ()):
        optim.pop(key, None)
    for key, value in ADDED_OPTIM_KEYS.items():
        if arm in arms_taking(key):
            optim.setdefault(key, value)
    return saved


def config_changes(saved: dict[str, Any], current: RunConfig) -> dict[str, tuple[Any, Any]]:
    """Math key -> (saved value, current value) for every key that differs, sorted by key."""
    before = math_fields(RunConfig.model_validate(as_it_ran(saved)))
    after = math_fields(current)
    return {k: (before.get(k), after.get(k)) for k in sorted(before.keys() | after.keys())
            if before.get(k) != after.get(k)}
