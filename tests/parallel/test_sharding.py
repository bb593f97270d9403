"""`[parallel]`: the strategy and the sharding rule, refused or applied (the sharded training
itself runs under torchrun: tests/distributed/test_fsdp.py)."""

from __future__ import annotations

import pytest

from harness.config import load_config
from harness.models.contract import build_model
from harness.parallel.sharding import shard_units
from procs import TINY, assert_one_line_error, harness


@pytest.mark.parametrize("setting, needle", [
    ("parallel.strategy=zero", "parallel.strategy"),
    ("parallel.shard_modules=h.(", "is not a regular expression"),
])
def test_bad_parallel_settings_are_one_line_errors(tmp_path, setting, needle):
    assert_one_line_error(harness("train", str(TINY), "--run-dir", str(tmp_path / "run"), "--set", setting), needle)


def test_the_default_rule_shards_every_transformer_block_deepest_first():
    cfg = load_config(TINY, ["model.args.n_layer=3"])
    model = build_model(cfg.model.factory, {"seq_len": 16, **cfg.model.args})
    assert shard_units(model, cfg.parallel.shard_modules) == ["blocks.0", "blocks.1", "blocks.2"]
    assert shard_units(model, r"blocks\.\d+(\.attn)?") == ["blocks.0.attn", "blocks.1.attn", "blocks.2.attn",
                                                           "blocks.0", "blocks.1", "blocks.2"]
