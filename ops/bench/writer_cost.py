"""What a checkpoint writer beside the training step costs the step, writer design by writer design.

The profile behind the harness's writer (storage/direct_io.py, location.py `write_stream`): a
1-thread training step (scale.py's `TrainingStep`: the harness's GPT, 4 layers, 256 wide) runs
while a thread writes `--gib` GiB of random float32 (16 MiB pieces) to a file in `--dir`, fsyncs
it and removes it, one design after another in each of `--rounds` rounds. Per design: the median
step beside the writer over the median of the steps just before it (same round), and the writer's
seconds. The designs:
* `hash only`, `copy only`: a thread hashing (BLAKE3, one thread) or copying memory (torch) in a
  loop, no file: what a core's worth of GIL-free work beside the step costs it;
* `python spin`: a thread running Python in a loop (it holds the GIL);
* `buffered write`: the pieces written through the page cache;
* `buffered + hash thread`: the same with each piece hashed in a second thread (the harness's
  writer before `direct_io`);
* `buffered + hash inline`: hashed on the writing thread;
* `direct + hash inline`: the harness's writer now (`write_stream` to a local disk).

    python ops/bench/writer_cost.py [--gib 4] [--rounds 3] [--dir /tmp] [--designs "direct + hash inline,..."]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import blake3
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness.storage.direct_io import DirectWriter  # noqa: E402
from scale import TrainingStep  # noqa: E402

PIECE = 16 << 20


Pieces = list[memoryview]


def hash_only(pieces: Pieces, _path: Path, stop: threading.Event) -> None:
    while not stop.is_set():
        for p in pieces[:64]:
            blake3.blake3(max_threads=1).update(p)


def copy_only(pieces: Pieces, _path: Path, stop: threading.Event) -> None:
    into = torch.empty(PIECE, dtype=torch.uint8)
    while not stop.is_set():
        for p in pieces[:64]:
            into[:len(p)].copy_(torch.frombuffer(p, dtype=torch.uint8))


def python_spin(_pieces: Pieces, _path: Path, stop: threading.Event) -> None:
    n = 0
    while not stop.is_set():
        n += 1


def write(pieces: Pieces, path: Path, direct: bool, hash_piece: Callable[[memoryview], object] | None) -> None:
    """The pieces written to `path` (around the page cache with `direct`), each given to
    `hash_piece` first, then flushed, fsynced and removed."""
    with DirectWriter(str(path)) if direct else open(path, "wb") as f:
        for p in pieces:
            if hash_piece is not None:
                hash_piece(p)
            f.write(p)
        f.flush()
        os.fsync(f.fileno())
    path.unlink()


def hash_thread_write(pieces: Pieces, path: Path, _stop: threading.Event) -> None:
    h, pool = blake3.blake3(max_threads=1), ThreadPoolExecutor(1)
    pending = []
    write(pieces, path, False, lambda p: pending.append(pool.submit(h.update, p)))
    for done in pending:
        done.result()
    pool.shutdown()


DESIGNS: dict[str, Callable[[Pieces, Path, threading.Event], None]] = {
    "hash only": hash_only, "copy only": copy_only, "python spin": python_spin,
    "buffered write": lambda pieces, path, _stop: write(pieces, path, False, None),
    "buffered + hash thread": hash_thread_write,
    "buffered + hash inline": lambda pieces, path, _stop: write(pieces, path, False, blake3.blake3().update),
    "direct + hash inline": lambda pieces, path, _stop: write(pieces, path, True, blake3.blake3().update),
}


def beside(step: TrainingStep, writer: Callable[[threading.Event], None], steps: int) -> tuple[float, float]:
    """(median step beside `writer` / median step just before, the writer's seconds); a looping
    writer is stopped after `steps` steps beside it."""
    alone = [step() for _ in range(steps)]
    stop = threading.Event()
    t0 = time.perf_counter()
    thread = threading.Thread(target=writer, args=(stop,))
    thread.start()
    during = [step()]  # at least one, however short the write
    while thread.is_alive():
        if len(during) >= steps:
            stop.set()  # a loop stops here; a write goes on to its end
        during.append(step())
    thread.join()
    return statistics.median(during) / statistics.median(alone), time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=4.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=6, help="steps timed alone before each design, and at least beside it")
    p.add_argument("--dir", default=tempfile.gettempdir())
    p.add_argument("--designs", default=",".join(DESIGNS), help="which designs, comma-separated (default: all)")
    args = p.parse_args()
    chosen = {name: DESIGNS[name] for name in args.designs.split(",")}
    torch.set_num_threads(1)
    state = torch.rand(max(PIECE // 4, round(args.gib * 2**30) // 4), generator=torch.Generator().manual_seed(0))
    step = TrainingStep("cpu")
    view = memoryview(state.view(torch.uint8).numpy())
    pieces = [view[at:at + PIECE] for at in range(0, len(view), PIECE)]
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        rows: dict[str, list[tuple[float, float]]] = {name: [] for name in chosen}
        for _ in range(args.rounds):
            for name, design in chosen.items():
                os.sync()
                rows[name].append(beside(step, partial(design, pieces, Path(tmp) / "file"), args.steps))
    print(f"{state.numel() * 4 / 2**30:.2f} GiB, a 1-thread training step beside each writer, {args.rounds} rounds "
          f"(medians; load average {os.getloadavg()[0]:.1f}):")
    for name, got in rows.items():
        ratios = [r for r, _ in got]
        print(f"  {name:24s} step {statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}), "
              f"writer {statistics.median(s for _, s in got):.2f} s")


if __name__ == "__main__":
    main()
