"""The config reference (harness/config/reference.py) is complete and current: docs/config.md is
what `harness config keys --markdown` prints, every key has a description, and every key outside
[optim] names the module that reads it, which must read an attribute of that name, so a key
nothing reads (accepted, then ignored) fails here. A key read only in some modes is
harness/config/effects.py's (tests/config/test_effects.py)."""

from __future__ import annotations

import ast
import subprocess
import sys
from functools import cache

import pytest

from harness.config.reference import markdown, sections
from procs import ENV, ROOT, TINY, harness

DOC = ROOT / "docs" / "config.md"
KEYS = [k for s in sections() for k in s.keys]

# Each key's reader: the module where the run takes it from the config (its first reader, where
# several do). [optim]'s keys are optim/build.py's, checked by tests/optim.
CONSUMERS = {
    "run_dir": "harness/run/session.py",
    "log_dir": "harness/run/session.py",
    "task.factory": "harness/task/loading.py",
    "task.args": "harness/task/loading.py",
    "model.factory": "harness/task/language_model.py",
    "model.args": "harness/config/run.py",  # model_args: what the factory is called with
    "model.init_from": "harness/run/trainer.py",
    "data.url": "harness/data/sources.py",
    "data.sources": "harness/data/sources.py",
    "data.sources[].url": "harness/data/sources.py",
    "data.sources[].weight": "harness/data/sources.py",
    "data.sources[].storage_options": "harness/data/sources.py",
    "data.eval_sources": "harness/data/sources.py",
    "data.eval_sources[].url": "harness/data/sources.py",
    "data.eval_sources[].weight": "harness/data/sources.py",
    "data.eval_sources[].storage_options": "harness/data/sources.py",
    "data.factory": "harness/data/sources.py",
    "data.args": "harness/data/sources.py",
    "data.hash_check": "harness/data/sources.py",
    "data.seq_len": "harness/data/sources.py",
    "data.batch_size": "harness/config/batch.py",
    "data.num_workers": "harness/run/trainer.py",
    "data.eval_fraction": "harness/data/sources.py",
    "data.storage_options": "harness/data/sources.py",
    "train.steps": "harness/run/loop.py",
    "train.seed": "harness/run/trainer.py",
    "train.grad_accum": "harness/config/batch.py",
    "train.global_batch": "harness/config/batch.py",
    "train.grad_clip": "harness/run/trainer.py",
    "train.precision": "harness/run/trainer.py",
    "train.device": "harness/run/trainer.py",
    "train.compile": "harness/run/trainer.py",
    "train.cpu_threads": "harness/run/trainer.py",
    "train.host_heap": "harness/run/session.py",
    "train.eval_every": "harness/run/loop.py",
    "train.eval_batches": "harness/run/trainer.py",
    "train.log_every": "harness/run/loop.py",
    "train.fingerprint_every": "harness/run/trainer.py",
    "train.on_divergence": "harness/run/trainer.py",
    "train.unregistered_state": "harness/run/trainer.py",
    "train.on_anomaly": "harness/run/loop.py",
    "train.spike_threshold": "harness/run/trainer.py",
    "train.spike_window": "harness/run/trainer.py",
    "train.rollback_skip": "harness/run/rollback.py",
    "train.max_rollbacks": "harness/run/rollback.py",
    "train.rollback_window": "harness/run/rollback.py",
    "checkpoint.every_steps": "harness/run/loop.py",
    "checkpoint.mtbf_hours": "harness/run/loop.py",
    "checkpoint.async_save": "harness/run/loop.py",
    "checkpoint.staging_mib": "harness/run/loop.py",
    "checkpoint.writer_cores": "harness/run/session.py",
    "checkpoint.when_busy": "harness/run/loop.py",
    "checkpoint.every_minutes": "harness/run/loop.py",
    "checkpoint.keep_last": "harness/run/session.py",
    "checkpoint.keep_every": "harness/run/session.py",
    "checkpoint.preempt_signals": "harness/run/loop.py",
    "checkpoint.preempt_deadline_s": "harness/run/loop.py",
    "checkpoint.storage_options": "harness/run/session.py",
    "checkpoint.save_deadline_s": "harness/run/loop.py",
    "checkpoint.lease_heartbeat_s": "harness/run/session.py",
    "checkpoint.local_dir": "harness/run/loop.py",
    "checkpoint.local.dir": "harness/checkpoint/save/node_folders.py",
    "checkpoint.local.every_steps": "harness/run/loop.py",
    "checkpoint.local.keep": "harness/checkpoint/save/node_folders.py",
    "checkpoint.local.peer_jump": "harness/checkpoint/save/peer_copies.py",
    "parallel.strategy": "harness/run/trainer.py",
    "parallel.shard_modules": "harness/parallel/sharding.py",
    "parallel.param_dtype": "harness/parallel/sharding.py",
    "parallel.exact_elastic": "harness/run/trainer.py",
    "health.hang_watchdog": "harness/run/loop.py",
    "health.hang_factor": "harness/run/loop.py",
    "health.hang_floor_s": "harness/run/loop.py",
    "health.first_step_s": "harness/run/loop.py",
    "log.trackers": "harness/health/trackers/__init__.py",
    "log.wandb_mode": "harness/health/trackers/__init__.py",
    "log.wandb_project": "harness/health/trackers/__init__.py",
    "log.mlflow_tracking_uri": "harness/health/trackers/__init__.py",
    "log.mlflow_experiment": "harness/health/trackers/__init__.py",
    "debug.crash_at_step": "harness/health/debug_hooks.py",
    "debug.crash_mode": "harness/health/debug_hooks.py",
    "debug.crash_once": "harness/health/debug_hooks.py",
    "debug.step_sleep_s": "harness/health/debug_hooks.py",
    "debug.persist_delay_s": "harness/run/loop.py",
    "debug.fail_save_rank": "harness/run/loop.py",
    "debug.fail_save_step": "harness/run/loop.py",
    "debug.hang_at_step": "harness/health/debug_hooks.py",
    "debug.hang_in": "harness/health/debug_hooks.py",
    "debug.hang_rank": "harness/health/debug_hooks.py",
    "debug.nan_at_steps": "harness/health/debug_hooks.py",
    "debug.spike_at_steps": "harness/health/debug_hooks.py",
    "debug.nan_rank": "harness/health/debug_hooks.py",
    "debug.sample_log": "harness/run/session.py",
}


@cache
def attributes_read(module: str) -> set[str]:
    tree = ast.parse((ROOT / module).read_text())
    return {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}


def test_docs_config_md_is_the_generated_reference():
    assert DOC.read_text() == markdown(), \
        "docs/config.md is stale: regenerate it with `harness config keys --markdown > docs/config.md`"


def test_every_key_has_a_description_type_and_default():
    for k in KEYS:
        assert k.what.strip() and k.type and k.default, f"{k.key}: describe it (Field(description=...))"


@pytest.mark.parametrize("key", [k.key for k in KEYS if not k.key.startswith("optim.")])
def test_every_key_names_the_module_that_reads_it(key):
    assert key in CONSUMERS, f"{key}: add the module that reads it to CONSUMERS (a key nothing reads is ignored)"
    leaf = key.rsplit(".", 1)[-1]
    assert leaf in attributes_read(CONSUMERS[key]), f"{CONSUMERS[key]} reads no attribute {leaf!r} ({key})"


def test_consumers_lists_no_key_that_is_gone():
    assert not set(CONSUMERS) - {k.key for k in KEYS}


def test_the_reference_takes_every_section_and_optim_type():
    titles = [s.title for s in sections()]
    assert titles[:5] == ["top level", "[task]", "[model]", "[data]", "[optim]"]
    assert {'[optim] type = "muon"', "[checkpoint.local]", "[debug]"} <= set(titles)
    spike = next(k for k in KEYS if k.key == "train.spike_window")
    assert (spike.type, spike.default, spike.resume) == ("integer >= 8", "100", "free")
    assert spike.only == "with train.spike_threshold set (spikes are checked only then)"
    lr = next(k for k in KEYS if k.key == "optim.lr_muon")
    assert (lr.type, lr.default, lr.resume) == ("number > 0", "0.02", "math")
    assert next(k for k in KEYS if k.key == "checkpoint.local.dir").default == "required"


def test_config_keys_prints_a_section_and_refuses_an_unknown_one():
    shown = harness("config", "keys", "checkpoint.local", check=True).stdout
    assert "checkpoint.local.peer_jump = unset" in shown and "checkpoint.every_steps = 50" not in shown
    unknown = harness("config", "keys", "trian")
    assert unknown.returncode == 2 and "no config key is or starts with 'trian'; the sections are task," in \
        unknown.stderr


def test_config_show_prints_the_resolved_config_that_reads_back_the_same(tmp_path):
    shown = harness("config", "show", str(TINY), "--set", "train.global_batch=16", "--set", "train.grad_accum=null",
                    "--set", 'checkpoint.storage_options.secret="s3cret"', check=True).stdout
    assert "\n[train]\nsteps = 12\nseed = 1\n# grad_accum = 1\nglobal_batch = 16\n" in shown, shown
    assert 's3cret' not in shown and 'storage_options = { secret = "<redacted>" }' in shown
    (tmp_path / "resolved.toml").write_text(shown)
    assert harness("config", "show", str(tmp_path / "resolved.toml"), check=True).stdout == shown


def test_config_commands_import_no_torch():
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "harness.cli", "config", "keys"],
                          capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=300)
    assert proc.returncode == 0 and "train.steps" in proc.stdout, proc.stderr[-2000:]
    imported = {line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "harness.config.reference" in imported and "torch" not in imported
