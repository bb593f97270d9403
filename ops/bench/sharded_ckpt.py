"""Sharded checkpoint I/O at world size 2: the harness's DCP storage layer against DCP's own.

Two processes (torchrun, gloo, CPU) hold an FSDP2-sharded stack of square layers and AdamW
state (both moments) of about `--size-mib` in all. Each round, the contenders take turns:
* save ours: `GroupCommit` of a snapshot whose model and optimizer parts are sharded (what
  `harness train` does under `parallel.strategy = "fsdp"`): DCP's `save` and default planner
  through our StorageWriter (one safetensors file per rank, JSON metadata, BLAKE3 of every byte,
  fsync), every rank's records gathered, the manifest written and the folder renamed by rank 0;
* save dcp: `dcp.save` with `FileSystemWriter` (fsync on: `sync_files=True`, its default) into a
  fresh folder, the same state dict;
* load ours: `CheckpointStore.restore` into the live sharded model and optimizer state, with
  `Verify.NO` (sizes and headers, like DCP) and `Verify.WHILE` (every byte hashed: a resume);
* load dcp: `dcp.load` with `FileSystemReader` into the same live tensors.
* async: the step loop's blocking time of a background save, ours (`AsyncSaver` over the group
  commit on a side gloo group: each rank copies its shards into reused CPU buffers, then
  persists in a thread) against `dcp.async_save` (FileSystemWriter), and the time until each
  save is on disk.
Loads are cold: every file is evicted from the page cache (posix_fadvise) first. Memory: in the
first round, each rank's peak RSS above its resident state during each contender (the peak is
reset before each, /proc/self/clear_refs), the largest over the ranks, next to one rank's share
of the state: a sharded save or load should need about that much at most. Figures are the
best of `--repeat` rounds, in GB/s of the whole state (both ranks), timed from a barrier before
to a barrier after. Run: `python ops/bench/sharded_ckpt.py --size-mib 512 --repeat 3` (it starts
torchrun itself).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def launch(argv: list[str]) -> int:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    return subprocess.call([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                            __file__, "--worker", *argv], env=env)


def evict(folder: Path) -> None:
    for path in folder.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def reset_peak() -> int:
    """Reset this process's peak RSS to its current RSS (Linux); returns the current RSS."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status("VmRSS")


def peak() -> int:
    return _status("VmHWM")


class Tree:
    """A state part holding a plain tree (the optimizer state of the benchmark)."""

    def __init__(self, tree: dict) -> None:
        self.tree = tree

    def state_dict(self) -> dict:
        return self.tree

    def load_state_dict(self, tree: dict) -> None:
        self.tree = tree


def worker(size_mib: int, repeat: int, base: Path) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch import nn

    from harness.checkpoint import CheckpointStore, Verify, load
    from harness.checkpoint.format import capture
    from harness.checkpoint.save.group_commit import GroupCommit
    from harness.config import ParallelSection
    from harness.parallel import distributed
    from harness.parallel.sharding import materialize_optimizer_state, shard_model

    with distributed.process_group("cpu") as topo:
        width = 1024
        layers = max(1, round(size_mib * 2**20 / 3 / (width * width * 4)))
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])
        shard_model(model, ParallelSection(), torch.device("cpu"), topo.world_size)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        materialize_optimizer_state({"adamw": opt})
        names = {p: n for n, p in model.named_parameters()}
        optim = Tree({names[p]: {k: v for k, v in s.items()} for p, s in opt.state.items()})
        parts = {"model": model, "optim": optim}
        flat = {**{f"model/{k}": v for k, v in model.state_dict().items()},
                **{f"optim/{n}/{k}": v for n, s in optim.tree.items() for k, v in s.items()}}
        nbytes = sum(v.numel() * v.element_size() for v in flat.values())
        store = CheckpointStore(str(base / "ours"), keep_last=2)
        commit = GroupCommit(store)
        best: dict[str, float] = {}
        extra: dict[str, int] = {}

        def timed(label: str, fn) -> None:
            dist.barrier()
            rss = reset_peak()
            t0 = time.perf_counter()
            fn()
            dist.barrier()
            best[label] = min(best.get(label, float("inf")), time.perf_counter() - t0)
            extra.setdefault(label, max(distributed.all_gather_object(peak() - rss)))

        for step in range(1, repeat + 1):
            target = base / f"dcp-{step}"
            timed("save ours",
                  lambda step=step: commit(step, capture(parts, rank=topo.rank, sharded={"model", "optim"})))
            timed("save dcp", lambda target=target: dcp.save(flat, storage_writer=dcp.FileSystemWriter(str(target))))
            checkpoint = store.open(store.ref(step))
            for label, verify in (("load ours", Verify.NO), ("load ours verified", Verify.WHILE)):
                if topo.rank == 0:
                    evict(base / "ours")
                timed(label, lambda checkpoint=checkpoint, verify=verify: load(store, checkpoint, parts, verify=verify))
            if topo.rank == 0:
                evict(target)
            timed("load dcp", lambda target=target: dcp.load(flat, storage_reader=dcp.FileSystemReader(str(target))))
            dist.barrier()
            if topo.rank == 0:
                shutil.rmtree(target)
        blocking, persisted = measure_async(store, parts, flat, base, topo.rank, repeat)
        if topo.rank == 0:
            print(f"state {nbytes / 2**20:.0f} MiB over 2 ranks ({layers} layers of {width}x{width} + AdamW), "
                  f"best of {repeat}")
            for label, seconds in best.items():
                print(f"  {label:20} {seconds:7.3f} s  {nbytes / seconds / 1e9:6.3f} GB/s   peak RSS above the state "
                      f"{extra[label] / 2**20:6.1f} MiB (a rank's share of the state: {nbytes / 2 / 2**20:.0f} MiB)")
            for label in blocking:
                print(f"  async {label:14} blocks the step {blocking[label]:7.3f} s, "
                      f"on disk after {persisted[label]:7.3f} s")
            print(f"  save ours / dcp: {best['save dcp'] / best['save ours']:.2f}x   load ours / dcp: "
                  f"{best['load dcp'] / best['load ours']:.2f}x   load verified / dcp: "
                  f"{best['load dcp'] / best['load ours verified']:.2f}x")


def measure_async(store, parts: dict, flat: dict, base: Path, rank: int, repeat: int) -> tuple[dict, dict]:
    """Best (blocking seconds, seconds until committed) of a background save, ours and DCP's."""
    import torch.distributed.checkpoint as dcp

    from harness.checkpoint.save.async_saver import AsyncSaver
    from harness.checkpoint.save.group_commit import GroupCommit
    from harness.parallel import distributed

    side = distributed.new_side_group(600)
    saver = AsyncSaver(GroupCommit(store, group=side), rank=rank, sharded={"model", "optim"})
    blocking: dict[str, float] = {}
    persisted: dict[str, float] = {}
    for step in range(100, 100 + repeat):
        contenders = {
            "ours": (lambda step=step: saver.save(step, parts), lambda _: saver.finish()),
            "dcp": (lambda step=step: dcp.async_save(
                        flat, storage_writer=dcp.FileSystemWriter(str(base / f"dcp-async-{step}")), process_group=side),
                    lambda future: future.result()),
        }
        for name, (start, wait) in contenders.items():
            blocked, done = _background_save_times(start, wait)
            blocking[name] = min(blocking.get(name, float("inf")), blocked)
            persisted[name] = min(persisted.get(name, float("inf")), done)
    saver.close()
    return blocking, persisted


def _background_save_times(start, wait) -> tuple[float, float]:
    """(seconds `start()` blocked the caller, seconds until `wait(start's result)` returned on every rank)."""
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    handle = start()
    blocked = time.perf_counter() - t0
    wait(handle)
    dist.barrier()
    return blocked, time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-mib", type=int, default=512)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not args.worker:
        base = Path(args.dir or tempfile.mkdtemp(prefix="sharded-ckpt-"))
        try:
            sys.exit(launch(["--size-mib", str(args.size_mib), "--repeat", str(args.repeat), "--dir", str(base)]))
        finally:
            if args.dir is None:
                shutil.rmtree(base, ignore_errors=True)
    worker(args.size_mib, args.repeat, Path(args.dir))


if __name__ == "__main__":
    main()
