"""S3 checkpoint I/O benchmark: the harness store against boto3's transfer manager, same server.

For a model of about `--size-mib` (default 256) of float32 weights, in one run against one local
S3 server (ops/s3/local_server.py, moto, started here in its own process on loopback):
* save: `CheckpointStore.save` to s3:// (serialize, hash, multipart upload through the retrying
  s3fs, manifest last, retention listing) against `boto3` `upload_file` of the same files (the
  checkpoint's bytes, staged on local disk beforehand: boto3 does not serialize or hash);
* load: `CheckpointStore.load` of that checkpoint into a live model (streaming range reads into
  the tensors) against `boto3` `download_file` of the same objects to local disk;
* verify: the hash pass `latest_good` makes before a resume, on its own;
* the server's own share of a save: the seconds each save spent in CompleteMultipartUpload (the
  server assembling the object from its parts: moto joins them in Python, 40-65% of a 256 MiB
  save here, the same request from both clients) and the save ratio without it, which is the
  part a client can change;
* the fixed cost of one save, whatever its size: median seconds of `--fixed-rounds` saves of a
  tiny checkpoint (a 64x64 layer) against `upload_file` of its files (the store's commit protocol
  and retention make S3 requests that a plain upload does not).

Figures are MiB/s of checkpoint bytes, best of `--repeat` rounds; the two saves take turns going
first (boto3 uploads the files of a checkpoint staged before the first round). The server is
moto (Python, in memory): it bounds both sides alike, so the ratio is the figure to read, not the
absolute speed. Run: `python ops/bench/s3_io.py --size-mib 256`.

`--server-cpus 1` pins the server to those CPUs and this process (both clients) to the others, as
when the endpoint is another machine: on a 2-core box the unpinned run makes every client
CPU-second (the store serializes and hashes; `upload_file` of staged files does neither) a
second taken from the server's share.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import boto3
import torch
from botocore.config import Config
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from harness.checkpoint import CheckpointStore, load  # noqa: E402
from ops.s3.local_server import PLACEHOLDER_ENV  # noqa: E402

WIDTH = 2048
BUCKET = "bench"


def build(size_mib: int, seed: int) -> nn.Module:
    layers = max(1, round(size_mib * 2**20 / (WIDTH * WIDTH * 4)))
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(layers)])


def pin(pid: int, cpus: set[int]) -> None:
    """Every thread of process `pid` onto `cpus` (affinity is per thread; new threads inherit it)."""
    for thread in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(thread), cpus)


def start_server(cpus: set[int] | None) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # moto keeps an object over ~5 MiB in a temporary file on disk; deleting one (the store's
    # retention does) then costs the server disk time charged to whoever uploads next. Kept in
    # memory, the server is the in-memory endpoint this benchmark means to be.
    env = {**os.environ, "MOTO_S3_DEFAULT_KEY_BUFFER_SIZE": str(4 << 30)}
    proc = subprocess.Popen([sys.executable, str(ROOT / "ops/s3/local_server.py"), "--port", str(port),
                             "--bucket", BUCKET], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    proc.stdout.readline()  # the "S3 server on ..." line: bucket created, serving
    if cpus:
        clients = set(os.sched_getaffinity(0)) - cpus
        pin(proc.pid, cpus)
        pin(os.getpid(), clients)
        torch.set_num_threads(len(clients))
    return proc, f"http://127.0.0.1:{port}"


def boto3_client(endpoint: str):
    """boto3 with the store's S3 settings where they change the work per byte: bodies unsigned,
    checksummed (what both do over https anyway; see storage/s3.py)."""
    return boto3.client("s3", endpoint_url=endpoint, config=Config(s3={"payload_signing_enabled": False}))


def _upload(client, staged: dict[str, Path], prefix: str) -> None:
    """boto3 `upload_file` of every staged file under `prefix`."""
    for path in staged.values():
        client.upload_file(str(path), BUCKET, f"{prefix}/{path.name}")


def _download(client, ref, folder: Path) -> dict[str, Path]:
    """boto3 `download_file` of every object of the checkpoint `ref` into `folder`: key -> file."""
    prefix = ref.path.split("/", 1)[1]
    local = {o["Key"]: folder / o["Key"].rsplit("/", 1)[1]
             for o in client.list_objects_v2(Bucket=BUCKET, Prefix=prefix)["Contents"]}
    for key, path in local.items():
        client.download_file(BUCKET, key, str(path))
    return local


def _perturb(model: nn.Module, seed: int) -> None:
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 1e-3)


class CompletionClock:
    """Seconds a contender's client spends in CompleteMultipartUpload since `reset` (botocore's
    call events; the store's aiobotocore client emits the same ones)."""

    def __init__(self, clients: dict[str, Any]):
        self.seconds = dict.fromkeys(clients, 0.0)
        self._started: dict[str, float] = {}
        for name, client in clients.items():
            client.meta.events.register("before-call.s3.CompleteMultipartUpload", functools.partial(self._start, name))
            client.meta.events.register("after-call.s3.CompleteMultipartUpload", functools.partial(self._stop, name))

    def _start(self, name: str, **_) -> None:
        self._started[name] = time.perf_counter()

    def _stop(self, name: str, **_) -> None:
        self.seconds[name] += time.perf_counter() - self._started.pop(name)

    def reset(self) -> None:
        self.seconds = dict.fromkeys(self.seconds, 0.0)


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--fixed-rounds", type=int, default=10)
    parser.add_argument("--server-cpus", type=lambda text: {int(c) for c in text.split(",")}, default=None,
                        help="CPUs for the server, e.g. 1; the clients get the rest (default: all share all)")
    args = parser.parse_args()
    if args.server_cpus and not args.server_cpus < set(os.sched_getaffinity(0)):
        parser.error(f"--server-cpus {sorted(args.server_cpus)}: leave at least one of CPUs "
                     f"{sorted(os.sched_getaffinity(0))} for the clients")
    os.environ.update(PLACEHOLDER_ENV)
    server, endpoint = start_server(args.server_cpus)
    try:
        result = run(args.size_mib, args.repeat, endpoint)
        result["fixed_seconds"] = fixed_costs(args.fixed_rounds, endpoint)
        result["server_cpus"] = sorted(args.server_cpus) if args.server_cpus else "shared"
        print(json.dumps(result, indent=2))
    finally:
        server.terminate()
        server.wait()


def run(size_mib: int, repeat: int, endpoint: str) -> dict:
    model = build(size_mib, seed=0)
    target = build(size_mib, seed=1)
    client = boto3_client(endpoint)
    store = CheckpointStore(f"s3://{BUCKET}/store", keep_last=2, storage_options={"endpoint_url": endpoint})
    clock = CompletionClock({"store_save": store.loc.fs.connect(), "boto3_upload": client})
    best: dict[str, float] = {}
    completion: dict[str, list[float]] = {"store_save": [], "boto3_upload": []}
    with tempfile.TemporaryDirectory() as tmp:
        staged = _download(client, store.save(0, {"model": model}), Path(tmp))  # what boto3 uploads
        nbytes = sum(p.stat().st_size for p in staged.values())
        for step in range(1, repeat + 1):
            _perturb(model, step)  # a different checkpoint each round
            ref = None

            def save(step=step):
                nonlocal ref
                ref = store.save(step, {"model": model})

            saves = [("store_save", save),
                     ("boto3_upload", lambda step=step: _upload(client, staged, f"boto3/{step}"))]
            clock.reset()
            rounds = {name: timed(fn) for name, fn in (saves if step % 2 else saves[::-1])}  # alternate who goes first
            for name in completion:
                completion[name].append(clock.seconds[name])
                rounds[f"{name}_less_completion"] = rounds[name] - clock.seconds[name]
            rounds["boto3_download"] = timed(lambda ref=ref: _download(client, ref, Path(tmp)))
            rounds["store_load"] = timed(lambda ref=ref: load(store, ref, {"model": target}))
            rounds["store_verify"] = timed(lambda ref=ref: store.verify(ref))
            assert all(torch.equal(a, b)
                       for a, b in zip(model.state_dict().values(), target.state_dict().values(), strict=True))
            for k, v in rounds.items():
                best[k] = min(best.get(k, v), v)
    mib = nbytes / 2**20

    def rate(key: str) -> float:
        return round(mib / best[key], 1)

    return {"checkpoint_mib": round(mib, 1), "repeat": repeat, "endpoint": "moto (local, loopback)",
            "mib_per_s": {k: rate(k) for k in best if not k.endswith("_less_completion")},
            "completion_seconds": {k: [round(v, 3) for v in values] for k, values in completion.items()},
            "save_ratio_less_completion": round(best["boto3_upload_less_completion"]
                                                / best["store_save_less_completion"], 2),
            "save_ratio_store_vs_boto3": round(best["boto3_upload"] / best["store_save"], 2),
            "load_ratio_store_vs_boto3": round(best["boto3_download"] / best["store_load"], 2)}


def fixed_costs(rounds: int, endpoint: str) -> dict[str, float]:
    """Median seconds of a tiny checkpoint's save (commit and retention) and of `upload_file` of
    its files, in a store of its own."""
    client = boto3_client(endpoint)
    store = CheckpointStore(f"s3://{BUCKET}/fixed", keep_last=2, storage_options={"endpoint_url": endpoint})
    model = nn.Linear(64, 64)
    times: dict[str, list[float]] = {"store_save": [], "boto3_upload": []}
    with tempfile.TemporaryDirectory() as tmp:
        staged = _download(client, store.save(0, {"model": model}), Path(tmp))
        for step in range(1, rounds + 1):
            times["store_save"].append(timed(lambda step=step: store.save(step, {"model": model})))
            times["boto3_upload"].append(timed(lambda step=step: _upload(client, staged, f"boto3-fixed/{step}")))
    return {name: round(statistics.median(values), 3) for name, values in times.items()}


if __name__ == "__main__":
    main()
