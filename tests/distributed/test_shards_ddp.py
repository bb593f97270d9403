"""The global order on token shards: world size 1 and 2 (DDP, gloo), 0 and 2 loader
workers, the same `train.global_batch`: every step's global batch (the batch hash over the
sample ids of all ranks, in cursor order) is identical step by step."""

from __future__ import annotations

from launch import COMMON, Ranks, run, tail
from procs import TINY, harness
from shard_data import batch_hashes, make_sources, sources_args

STEPS = 6


def test_world_size_and_workers_do_not_change_the_global_batches(tmp_path):
    a, b = make_sources(tmp_path)
    common = ["--set", f"train.steps={STEPS}", "--set", "train.global_batch=8", *COMMON]
    one = tmp_path / "one"
    harness("train", str(TINY), "--run-dir", str(one), *common, *sources_args(a, b), check=True)  # 4 x 2 x 1
    two, log = tmp_path / "two", tmp_path / "two.log"
    args = Ranks(("train", str(TINY), "--run-dir", str(two), *common, "--set", "data.batch_size=2",
                  *sources_args(a, b, workers=2)))  # 2 x 2 x 2
    assert run(args, log) == 0, tail(log)
    assert len(batch_hashes(one)) == STEPS
    assert batch_hashes(one) == batch_hashes(two)
