"""Token-shard loader benchmark: the harness's data path against the raw reads it is built on.

One run, synthetic uint16 shards (random ids; reading does not care what they mean):
* local: `BatchStream` over a `TokenDataset(ShardReader)` for `--batches` batches of `--batch`
  windows of `--seq-len` tokens, against nanoGPT's `get_batch` (x and y stacked from np.memmap
  slices) on the same windows: tokens/s and the ratio;
* S3 (moto on loopback, ops/s3/local_server.py): the same stream over s3://, against boto3
  ranged GETs of the same byte ranges on a thread pool as wide as s3fs's batch (10): ratio;
* memory: peak RSS of a child process that opens the dataset and reads the same number of
  batches, for a dataset `--scale` times larger (the order's permutation grows 8 bytes per
  sample; the tokens are never resident): ratio of the two;
* start-up: opening a dataset of 1,000 shards (index only) and reading the first batch.

Run: `python ops/bench/data_io.py` (about a minute here). Prints JSON.
"""

from __future__ import annotations

import argparse
import bisect
import hashlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from harness.data import BatchStream, TokenDataset  # noqa: E402
from harness.data.order import epoch_permutation  # noqa: E402
from harness.data.shard_index import ShardEntry, ShardIndex, shard_name  # noqa: E402
from harness.data.shard_reader import ShardReader  # noqa: E402
from ops.bench.s3_io import BUCKET, start_server  # noqa: E402
from ops.s3.local_server import PLACEHOLDER_ENV  # noqa: E402

VOCAB = 50257
SEED = 0


def write_dataset(folder: Path, tokens: int, shard_tokens: int) -> None:
    """Random uint16 shards and their index (no tokenizer file: reading never needs it)."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    entries = []
    for number, start in enumerate(range(0, tokens, shard_tokens)):
        data = rng.integers(0, VOCAB, min(shard_tokens, tokens - start), dtype=np.uint16).astype("<u2").tobytes()
        (folder / shard_name(number)).write_bytes(data)
        entries.append(ShardEntry(shard_name(number), len(data) // 2, 0, hashlib.sha256(data).hexdigest()))
    index = ShardIndex({"sha256": "synthetic", "vocab_size": VOCAB, "specials": {}, "eod_id": 0,
                        "eod_token": ""}, "uint16", tuple(entries))
    (folder / "index.json").write_bytes(index.to_json())


def harness_stream(url: str, seq_len: int, batch: int, storage_options: dict | None) -> BatchStream:
    dataset = TokenDataset(ShardReader.open(url, storage_options, hash_check="off"), seq_len)
    return BatchStream(dataset, batch, SEED)


def loader_seconds(url: str, seq_len: int, batch: int, batches: int, storage_options: dict | None = None) -> float:
    stream = harness_stream(url, seq_len, batch, storage_options)
    next(stream)  # opens the shards: start-up is measured on its own
    start = time.perf_counter()
    for _ in range(batches):
        next(stream)
    return time.perf_counter() - start


def windows_of(folder: Path, seq_len: int, batch: int, batches: int) -> list[np.ndarray]:
    """The token starts of the windows the stream reads in batches 1..batches (after the first)."""
    index = json.loads((folder / "index.json").read_text())
    total = sum(s["tokens"] for s in index["shards"])
    num = (total - 1) // seq_len
    perm = epoch_permutation(SEED, 0, num).numpy()
    return [perm[(b + 1) * batch:(b + 2) * batch] * seq_len for b in range(batches)]


def raw_memmap_seconds(folder: Path, seq_len: int, batch: int, batches: int) -> float:
    """The floor, nanoGPT's `get_batch` on the same windows: x and y int64 stacked from
    np.memmap slices (a window crossing into the next shard is joined)."""
    index = json.loads((folder / "index.json").read_text())
    offsets = np.cumsum([0] + [s["tokens"] for s in index["shards"]]).tolist()
    maps = [np.memmap(folder / s["name"], dtype="<u2", mode="r") for s in index["shards"]]
    starts = windows_of(folder, seq_len, batch, batches)

    def window(a: int) -> np.ndarray:
        s = bisect.bisect_right(offsets, a) - 1
        lo, hi = a - offsets[s], a - offsets[s] + seq_len + 1
        if hi <= len(maps[s]):
            return maps[s][lo:hi]
        return np.concatenate([maps[s][lo:], maps[s + 1][:hi - len(maps[s])]])

    begin = time.perf_counter()
    for batch_starts in starts:
        windows = [window(a) for a in batch_starts.tolist()]
        torch.stack([torch.from_numpy(w[:-1].astype(np.int64)) for w in windows])
        torch.stack([torch.from_numpy(w[1:].astype(np.int64)) for w in windows])
    return time.perf_counter() - begin


def boto3_seconds(client, folder: Path, prefix: str, seq_len: int, batch: int, batches: int) -> float:
    index = json.loads((folder / "index.json").read_text())
    offsets = np.cumsum([0] + [s["tokens"] for s in index["shards"]])
    names = [s["name"] for s in index["shards"]]
    starts = windows_of(folder, seq_len, batch, batches)

    def get(a: int) -> bytes:  # windows inside one shard only; the rare straddler reads its first part
        s = int(np.searchsorted(offsets, a, side="right") - 1)
        lo, hi = (a - offsets[s]) * 2, min((a + seq_len + 1), offsets[s + 1]) - offsets[s]
        got = client.get_object(Bucket=BUCKET, Key=f"{prefix}/{names[s]}", Range=f"bytes={lo}-{hi * 2 - 1}")
        return got["Body"].read()

    with ThreadPoolExecutor(10) as pool:
        begin = time.perf_counter()
        for batch_starts in starts:
            list(pool.map(get, [int(a) for a in batch_starts]))
        return time.perf_counter() - begin


def child_rss(url: str, seq_len: int, batch: int, batches: int) -> int:
    """Peak RSS (bytes) of a fresh process that reads `batches` batches from `url`."""
    out = subprocess.run([sys.executable, __file__, "--child", url, "--seq-len", str(seq_len), "--batch", str(batch),
                          "--batches", str(batches)], capture_output=True, text=True, check=True)
    return int(out.stdout.strip())


def run(args: argparse.Namespace, tmp: Path, endpoint: str) -> dict:
    small, large, many = tmp / "small", tmp / "large", tmp / "many"
    write_dataset(small, args.tokens, args.shard_tokens)
    write_dataset(large, args.tokens * args.scale, args.shard_tokens)
    write_dataset(many, 1000 * 4096, 4096)
    tokens = args.batches * args.batch * args.seq_len
    result: dict = {"tokens_per_batch": args.batch * args.seq_len, "batches": args.batches}

    loader = min(loader_seconds(str(small), args.seq_len, args.batch, args.batches) for _ in range(args.repeat))
    raw = min(raw_memmap_seconds(small, args.seq_len, args.batch, args.batches) for _ in range(args.repeat))
    result["local"] = {"loader_tokens_per_s": round(tokens / loader), "raw_memmap_tokens_per_s": round(tokens / raw),
                       "ratio": round(raw / loader, 3)}

    import boto3

    client = boto3.client("s3", endpoint_url=endpoint)
    for path in sorted(small.iterdir()):
        client.upload_file(str(path), BUCKET, f"small/{path.name}")
    options = {"endpoint_url": endpoint}
    s3_batches = max(1, args.batches // 10)
    s3_tokens = s3_batches * args.batch * args.seq_len
    remote = min(loader_seconds(f"s3://{BUCKET}/small", args.seq_len, args.batch, s3_batches, options)
                 for _ in range(args.repeat))
    direct = min(boto3_seconds(client, small, "small", args.seq_len, args.batch, s3_batches)
                 for _ in range(args.repeat))
    result["s3"] = {"batches": s3_batches, "loader_tokens_per_s": round(s3_tokens / remote),
                    "boto3_ranged_get_tokens_per_s": round(s3_tokens / direct), "ratio": round(direct / remote, 3)}

    rss_small = child_rss(str(small), args.seq_len, args.batch, args.batches)
    rss_large = child_rss(str(large), args.seq_len, args.batch, args.batches)
    result["peak_rss"] = {"small_tokens": args.tokens, "large_tokens": args.tokens * args.scale,
                          "small_mib": round(rss_small / 2**20, 1), "large_mib": round(rss_large / 2**20, 1),
                          "ratio": round(rss_large / rss_small, 3)}

    begin = time.perf_counter()
    stream = harness_stream(str(many), 1024, 8, None)
    opened = time.perf_counter()
    next(stream)
    result["startup_1000_shards"] = {"open_s": round(opened - begin, 4),
                                     "first_batch_s": round(time.perf_counter() - opened, 4)}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=16 << 20, help="tokens of the small dataset")
    parser.add_argument("--scale", type=int, default=10, help="the large dataset is this many times larger")
    parser.add_argument("--shard-tokens", type=int, default=4 << 20)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--child", metavar="URL", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        stream = harness_stream(args.child, args.seq_len, args.batch, None)
        for _ in range(args.batches + 1):
            next(stream)
        print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
        return
    os.environ.update(PLACEHOLDER_ENV)
    server, endpoint = start_server()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            print(json.dumps(run(args, Path(tmp), endpoint), indent=2))
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
