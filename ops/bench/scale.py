"""Checkpoints at scale: saves and resumes of 0.5-4 GiB of state against the machine's own limits,
in one process, each figure a ratio to its baseline measured in the same run.

The state is `--sizes` GiB of float32 tensors of 64 MiB each, in two parts ("model" and "optim",
a quarter and three quarters, as a model with AdamW's two moments), held as module buffers (what
a trainer's parts are). The run dir is a temporary folder on `--dir`'s file system. Per size:
* blocking: the time the step loop is held by `AsyncSaver.save` (the staging ring ready, as the
  step loop's `prepare` leaves it) against a plain `torch` copy of the same tensors into
  preallocated host memory (the limit); also per GiB;
* persist: the background save's seconds (serialize, hash, write, fsync, commit) against a raw
  write + fsync of the same bytes into two files (the limit; the mean of one before and one after
  the save, each after a sync), as throughput = raw / persist;
* step time while a save persists: a CPU step (matrix products on `--step-threads` threads, 1 by
  default: a core left for the writer on this 2-core machine) timed while the background save
  runs against the same step with no save, medians; and the writer's CPU-seconds per GiB (the
  process's CPU time during the persist minus the steps' own);
* RSS: the peak resident memory sampled every 5 ms during a save, minus the resident memory of the
  state alone, with the default ring (the state's size) and with `--cap-mib` (goal: under the cap
  plus 64 MiB);
* restore: `harness.checkpoint.load` (every byte hashed, read into the live tensors) against a raw
  `readinto` of the same files into preallocated memory, warm (page cache) and cold (the files'
  pages dropped with posix_fadvise DONTNEED after a sync).

    python ops/bench/scale.py --sizes 0.5,2,4 [--cap-mib 256] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from harness.checkpoint import CheckpointStore, load  # noqa: E402
from harness.checkpoint.save.async_saver import AsyncSaver  # noqa: E402
from harness.checkpoint.save.commit import Committed, Committer  # noqa: E402
from harness.log import configure  # noqa: E402

TENSOR = 16 << 20  # float32 elements: 64 MiB tensors
GIB = 1 << 30


def state_of(gib: float) -> dict[str, torch.nn.Module]:
    """`gib` GiB of random float32 buffers, a quarter in "model", the rest in "optim"."""
    count = max(2, round(gib * GIB / (TENSOR * 4)))
    parts = {"model": torch.nn.Module(), "optim": torch.nn.Module()}
    g = torch.Generator().manual_seed(0)
    for i in range(count):
        part = parts["model"] if i < max(1, count // 4) else parts["optim"]
        part.register_buffer(f"t{i:04d}", torch.rand(TENSOR, generator=g))
    return parts


def tensors_of(parts: dict[str, torch.nn.Module]) -> list[torch.Tensor]:
    return [t for part in parts.values() for t in part.buffers()]


def torch_copy_s(tensors: list[torch.Tensor]) -> float:
    """A plain copy of every tensor into preallocated (touched) host memory, best of two."""
    flat = torch.empty(sum(t.numel() for t in tensors), dtype=torch.float32)
    flat.zero_()
    best = float("inf")
    for _ in range(2):
        t0, at = time.perf_counter(), 0
        for t in tensors:
            flat[at:at + t.numel()].copy_(t)
            at += t.numel()
        best = min(best, time.perf_counter() - t0)
    return best


def raw_write_s(parts: dict[str, torch.nn.Module], folder: Path) -> float:
    """The tensors' bytes written to one file per part, each fsynced."""
    folder.mkdir(parents=True, exist_ok=True)
    os.sync()  # no writeback of earlier files in the timed one
    t0 = time.perf_counter()
    for name, part in parts.items():
        with open(folder / f"{name}.raw", "wb", buffering=0) as f:
            for t in part.buffers():
                f.write(memoryview(t.view(torch.uint8).numpy()))
            os.fsync(f.fileno())
    return time.perf_counter() - t0


def drop_cache(files: list[Path]) -> None:
    os.sync()
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def raw_read_s(files: list[Path], into: torch.Tensor) -> float:
    view, at = memoryview(into.view(torch.uint8).numpy()), 0
    t0 = time.perf_counter()
    for path in files:
        with open(path, "rb", buffering=0) as f:
            while True:
                got = f.readinto(view[at:at + (64 << 20)])
                if not got:
                    break
                at += got
    return time.perf_counter() - t0


class PeakRss:
    """The peak RSS of this process while in the block, sampled every 5 ms."""

    def __enter__(self) -> PeakRss:
        self.peak, self._stop = psutil.Process().memory_info().rss, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        proc = psutil.Process()
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, proc.memory_info().rss)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def step_s(a: torch.Tensor) -> float:
    t0 = time.perf_counter()
    for _ in range(4):
        a = (a @ a).tanh_()
    return time.perf_counter() - t0


def steps_while(saver: AsyncSaver, a: torch.Tensor) -> list[float]:
    times = []
    while saver.busy:
        times.append(step_s(a))
    return times


def save_once(parts, folder: Path, cap: int | None, step: int, a: torch.Tensor | None) -> dict:
    """One background save of `parts` into a fresh store: blocking and persist seconds, the peak
    RSS over the state's, and with `a` the step times while it persists and the writer's CPU."""
    store = CheckpointStore(str(folder), keep_last=2)
    committed: list[Committed] = []
    saver = AsyncSaver(Committer(store), staging_bytes=cap, on_commit=committed.append)
    saver.prepare(parts)
    ring = saver.ring.nbytes  # waits for the allocation: the step loop prepares long before a save
    base = psutil.Process().memory_info().rss - ring
    os.sync()  # as for the raw write
    with PeakRss() as peak:
        cpu0 = time.process_time()
        submitted = saver.save(step, parts)
        steps = steps_while(saver, a) if a is not None else []
        saver.finish()
        cpu = time.process_time() - cpu0
    out = {"blocking_s": submitted.blocking_s, "persist_s": committed[0].persist_s, "rss": peak.peak - base,
           "ring": saver.ring.nbytes, "steps": steps, "cpu_s": cpu}
    del saver
    return out


def restore_s(parts, folder: Path, cold: bool) -> float:
    store = CheckpointStore(str(folder))
    ref = store.latest_good()
    if cold:
        drop_cache(sorted(Path(ref.path).glob("*")))
    t0 = time.perf_counter()
    load(store, ref, parts)
    return time.perf_counter() - t0


def run_size(gib: float, args: argparse.Namespace, root: Path) -> None:
    parts = state_of(gib)
    tensors = tensors_of(parts)
    nbytes = sum(t.numel() * 4 for t in tensors)
    g = nbytes / GIB
    copy = torch_copy_s(tensors)
    raw_before = raw_write_s(parts, root / "raw")
    whole = save_once(parts, root / "whole", None, 1, None)
    raw = (raw_before + raw_write_s(parts, root / "raw")) / 2  # around the save: the disk's speed drifts
    capped = save_once(parts, root / "capped", args.cap_mib << 20, 1, None)
    a = torch.rand(args.step_size, args.step_size)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.step_threads)
    alone = [step_s(a) for _ in range(20)]
    during_save = save_once(parts, root / "during", None, 1, a)
    alone += [step_s(a) for _ in range(20)]  # before and after: the machine's load moves
    torch.set_num_threads(threads)
    raw_files = sorted((root / "raw").glob("*.raw"))
    into = torch.empty(nbytes // 4, dtype=torch.float32)
    into.zero_()
    raw_warm = min(raw_read_s(raw_files, into) for _ in range(2))
    drop_cache(raw_files)
    raw_cold = raw_read_s(raw_files, into)
    del into
    warm = min(restore_s(parts, root / "whole", cold=False) for _ in range(2))
    cold = restore_s(parts, root / "whole", cold=True)
    steps = during_save["steps"]
    during = statistics.median(steps) if steps else float("nan")
    step_cpu = sum(steps) * args.step_threads  # the steps' CPU time: about their wall time per thread
    print(f"{g:.2f} GiB: blocking {whole['blocking_s']:.3f} s ({whole['blocking_s'] / g:.3f} s/GiB) vs torch copy "
          f"{copy:.3f} s = {whole['blocking_s'] / copy:.2f}x; persist {whole['persist_s']:.2f} s vs raw write+fsync "
          f"{raw:.2f} s = throughput {raw / whole['persist_s']:.2f}x")
    print(f"  step during the persist {during * 1e3:.1f} ms vs {statistics.median(alone) * 1e3:.1f} ms alone = "
          f"{during / statistics.median(alone):.2f}x ({len(steps)} steps, {args.step_threads} thread); "
          f"writer CPU {(during_save['cpu_s'] - step_cpu) / g:.2f} s/GiB, its persist {during_save['persist_s']:.2f} s")
    print(f"  RSS during a save over the state: default ring {whole['rss'] / 2**20:.0f} MiB "
          f"(ring {whole['ring'] / 2**20:.0f} MiB); cap {args.cap_mib} MiB: {capped['rss'] / 2**20:.0f} MiB "
          f"(ring {capped['ring'] / 2**20:.0f} MiB), its blocking {capped['blocking_s']:.2f} s, "
          f"persist {capped['persist_s']:.2f} s")
    print(f"  restore warm {warm:.2f} s vs raw read {raw_warm:.2f} s = {warm / raw_warm:.2f}x; "
          f"cold {cold:.2f} s vs {raw_cold:.2f} s = {cold / raw_cold:.2f}x")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="0.5,2,4", help="GiB of state, comma-separated")
    p.add_argument("--cap-mib", type=int, default=256)
    p.add_argument("--dir", default=tempfile.gettempdir())
    p.add_argument("--step-threads", type=int, default=1)
    p.add_argument("--step-size", type=int, default=384)
    args = p.parse_args()
    configure("warning")
    print(f"{os.cpu_count()} CPUs, {psutil.virtual_memory().total / GIB:.0f} GiB; run dirs under {args.dir}")
    for gib in (float(s) for s in args.sizes.split(",")):
        with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
            run_size(gib, args, Path(tmp))


if __name__ == "__main__":
    main()
