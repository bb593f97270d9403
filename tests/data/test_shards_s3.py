"""Token shards on S3 (moto on loopback, a tenth of the requests faulted by the proxy): prepared
straight to s3://, read with ranged requests exactly as from local disk, and a training run on
two mixed S3 sources with 2 loader workers, SIGKILLed and resumed, is bitwise equal to a run
never interrupted."""

from __future__ import annotations

import numpy as np

import procs
from harness.cli import main
from harness.data.prepare import PrepareSpec, prepare
from harness.data.shard_reader import ShardReader
from procs import TINY, assert_same_run, harness, kill_at_step
from s3proxy import FaultPlan
from s3server import FAKE_ENV, options
from shard_data import batch_hashes, make_sources, sources_args

STEPS = 12


def test_shards_on_s3_read_like_local_ones(s3_server, proxy, s3_url, tmp_path, capsys):
    local = make_sources(tmp_path)[0]
    text = tmp_path / "a.txt"
    prepare(PrepareSpec((str(text),), "bytes", text_split="line", shard_tokens=20000), f"{s3_url}/a",
            storage_options=options(s3_server.endpoint))
    proxy.plan = FaultPlan(rate=0.1, seed=3)
    remote = ShardReader.open(f"{s3_url}/a", options(proxy.endpoint))
    here = ShardReader.open(local)
    assert remote.index.to_json() == here.index.to_json()
    starts = [0, 19990, len(here) - 17, 39990]
    assert np.array_equal(remote.read_windows(starts, 17), here.read_windows(starts, 17))
    assert np.array_equal(remote.read_windows([19000], 22000), here.read_windows([19000], 22000))  # spans 3 shards
    assert main(["data", "verify", f"{s3_url}/a", "-o", f"endpoint_url={proxy.endpoint}"]) == 0


def test_sigkill_training_on_two_s3_sources_is_bitwise(s3_server, proxy, s3_url, tmp_path, monkeypatch):
    for k, v in FAKE_ENV.items():
        monkeypatch.setitem(procs.ENV, k, v)
    local_a, local_b = make_sources(tmp_path)
    urls = []
    for name in ("a", "b"):
        prepare(PrepareSpec((str(tmp_path / f"{name}.txt"),), "bytes", text_split="line", shard_tokens=20000),
                f"{s3_url}/{name}", storage_options=options(s3_server.endpoint))
        urls.append(f"{s3_url}/{name}")
    proxy.plan = FaultPlan(rate=0.1, seed=11)
    extra = [*sources_args(*urls, workers=2), "--set", f"data.storage_options.endpoint_url={proxy.endpoint}",
             "--set", "data.storage_options.retry.initial=0.02", "--set", "data.storage_options.retry.max_wait=0.2"]
    cont, intr = tmp_path / "continuous", tmp_path / "interrupted"
    harness("train", str(TINY), "--run-dir", str(cont), *extra, check=True)
    args = ["train", str(TINY), "--run-dir", str(intr), *extra]
    for step in (6, 10):
        assert kill_at_step(args, intr, step) != 0, "the process finished before it could be killed"
    harness(*args, check=True)
    assert sum(proxy.faults.values()) >= 3, proxy.faults
    assert_same_run(cont, intr, STEPS)
    assert batch_hashes(cont) == batch_hashes(intr)
    # The same data from local disk: the same batches.
    local = tmp_path / "local"
    harness("train", str(TINY), "--run-dir", str(local), *sources_args(local_a, local_b), check=True)
    assert batch_hashes(local) == batch_hashes(cont)
