"""S3 checkpoint I/O benchmark: the harness store against boto3's transfer manager, same server.

For a model of about `--size-mib` (default 256) of float32 weights, in one run against one local
S3 server (ops/s3/local_server.py, moto, started here in its own process on loopback):
* save: `CheckpointStore.save` to s3:// (serialize, sha256, multipart upload through the retrying
  s3fs, manifest last, retention listing) against `boto3` `upload_file` of the same files (the
  checkpoint's bytes, staged on local disk beforehand: boto3 does not serialize or hash);
* load: `CheckpointStore.load` of that checkpoint into a live model (streaming range reads into
  the tensors) against `boto3` `download_file` of the same objects to local disk;
* verify: the sha256 pass `latest_good` makes before a resume, on its own.

Figures are MiB/s of checkpoint bytes, best of `--repeat` rounds, the contenders taking turns in
each round. The server is moto (Python, in memory): it bounds both sides alike, so the ratio is the
figure to read, not the absolute speed. Run: `python ops/bench/s3_io.py --size-mib 256`.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import boto3
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from harness.checkpoint import CheckpointStore  # noqa: E402
from ops.s3.local_server import PLACEHOLDER_ENV  # noqa: E402

WIDTH = 2048
BUCKET = "bench"


def build(size_mib: int, seed: int) -> nn.Module:
    layers = max(1, round(size_mib * 2**20 / (WIDTH * WIDTH * 4)))
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(layers)])


def start_server() -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, str(ROOT / "ops/s3/local_server.py"), "--port", str(port),
                             "--bucket", BUCKET], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    proc.stdout.readline()  # the "S3 server on ..." line: bucket created, serving
    return proc, f"http://127.0.0.1:{port}"


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    os.environ.update(PLACEHOLDER_ENV)
    server, endpoint = start_server()
    try:
        print(json.dumps(run(args.size_mib, args.repeat, endpoint), indent=2))
    finally:
        server.terminate()
        server.wait()


def run(size_mib: int, repeat: int, endpoint: str) -> dict:
    model = build(size_mib, seed=0)
    target = build(size_mib, seed=1)
    client = boto3.client("s3", endpoint_url=endpoint)
    store = CheckpointStore(f"s3://{BUCKET}/store", keep_last=2, storage_options={"endpoint_url": endpoint})
    best: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for step in range(1, repeat + 1):
            ref = None

            def save():
                nonlocal ref
                ref = store.save(step, {"model": model})

            rounds = {"store_save": timed(save)}
            prefix = ref.path.split("/", 1)[1]
            keys = [o["Key"] for o in client.list_objects_v2(Bucket=BUCKET, Prefix=prefix)["Contents"]]
            nbytes = sum(o["Size"] for o in client.list_objects_v2(Bucket=BUCKET, Prefix=prefix)["Contents"])
            local = {k: Path(tmp) / k.rsplit("/", 1)[1] for k in keys}
            rounds["boto3_download"] = timed(lambda: [client.download_file(BUCKET, k, str(p)) for k, p in local.items()])
            rounds["boto3_upload"] = timed(lambda: [client.upload_file(str(p), BUCKET, f"boto3/{step}/{p.name}")
                                                    for p in local.values()])
            rounds["store_load"] = timed(lambda: store.load(ref, {"model": target}))
            rounds["store_verify"] = timed(lambda: store.verify(ref))
            assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), target.state_dict().values()))
            for k, v in rounds.items():
                best[k] = min(best.get(k, v), v)
            torch.manual_seed(step)  # a different checkpoint each round
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn_like(p) * 1e-3)
    mib = nbytes / 2**20

    def rate(key: str) -> float:
        return round(mib / best[key], 1)

    return {"checkpoint_mib": round(mib, 1), "repeat": repeat, "endpoint": "moto (local, loopback)",
            "mib_per_s": {k: rate(k) for k in best},
            "save_ratio_store_vs_boto3": round(best["boto3_upload"] / best["store_save"], 2),
            "load_ratio_store_vs_boto3": round(best["boto3_download"] / best["store_load"], 2)}


if __name__ == "__main__":
    main()
