"""Resume latency: process start to training-ready of a resumed run, against a fresh start.

In one run, with one config (a GPT whose checkpoint is a few hundred MB; `--d-model` and
`--layers` set the size):
1. a run trains to step 1, checkpoints it, and crashes after step 2 (`debug.crash_at_step`);
2. `fresh`: the same command in a new run dir;
3. `resumed`: the same command again in the crashed run dir (it resumes from step 1);
each timed from process start to the moment it is ready to train its first step (the `startup_s`
of its `start` event: imports, building, finding and verifying the checkpoint, loading it), and
by the time the process itself spent restoring (`restore_s`: finding, verifying, loading and
checking the checkpoint; far less noisy than the difference of two process start times);
4. `raw read`: reading every file of another copy of the step-1 checkpoint into memory.
Steps 2-4 alternate `--repeat` times. Both are measured twice: warm (the checkpoint's files in the
page cache: the code path) and cold (the files evicted from the page cache with posix_fadvise
before the resume and before the raw read, as after a restart on another node). Each round pairs
a restore with the raw read taken right before or after it (the order alternates), and the
figure is the median of those per-round ratios with their range: a shared disk's speed moves by
2x from one minute to the next, so only reads close in time compare. Target: restore <= 1.2 x
raw read. Each resume also reports where its start went: the trainer's build (`build_s`: the
model's initial weights, the optimizer), the restore, the rest (imports, config, data), and its
resident memory when ready to train (`rss_bytes`) against the checkpoint's size.

`--back-memory-gib N`: before each timed resume and each raw read, a child process writes N GiB
and exits. In a virtual machine whose host takes freed memory back (virtio-balloon free page
reporting, as on the reference machine), the first write of a page the host took back costs
3-5x a plain page fault, and how many a process meets depends on what ran before it: the copies
this bench makes before each resume leave it memory the host must back anew, while a raw read
reuses what the process before it freed. With N at least the resumed process's memory, both find
memory the host has backed, and the ratio compares the code paths alone.

    python ops/bench/resume_latency.py --d-model 512 --layers 8
    python ops/bench/resume_latency.py --d-model 1024 --layers 28 --optim adamw --repeat 2   # 4 GiB of state
    python ops/bench/resume_latency.py --d-model 1024 --layers 28 --optim adamw --repeat 2 --back-memory-gib 8
    python ops/bench/resume_latency.py --d-model 1024 --layers 28 --optim adamw --repeat 2 --set train.host_heap=system
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "quickstart.toml"


def train(run_dir: Path, args: argparse.Namespace, *extra: str) -> dict:
    """The `start` event of the process: `startup_s` (process start to ready-to-train), `build_s`,
    `restore_s`, `rss_bytes`."""
    cmd = [sys.executable, "-m", "harness.cli", "--log-level", "warning", "train", str(CONFIG),
           "--run-dir", str(run_dir), "--set", "train.steps=3", "--set", "checkpoint.every_steps=1",
           "--set", f"model.args.d_model={args.d_model}", "--set", f"model.args.n_layer={args.layers}",
           "--set", "model.args.n_head=8", "--set", "data.batch_size=2", "--set", "train.eval_every=0",
           "--set", "debug.crash_at_step=2", "--set", "debug.crash_once=true", "--set", f"optim.type={args.optim}",
           *([] if args.optim == "muon" else ["--set", "optim.lr_muon=null"]),
           *(a for kv in args.set for a in ("--set", kv)), *extra]
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    starts = [e for e in _lines(run_dir / "events.jsonl") if e.get("event") == "start" and e["time"] >= t0]
    if not starts:
        raise SystemExit(f"the run did not start (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    return starts[0]


def _lines(path: Path):
    if path.exists():
        yield from (json.loads(line) for line in path.read_text().splitlines() if line.strip())


def evict(folder: Path) -> None:
    """Drop the folder's files from the page cache (clean pages only: `main` syncs each copy)."""
    for f in folder.iterdir():
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def back_memory(gib: float) -> None:
    """Have a child process write `gib` GiB of memory and exit (see `--back-memory-gib`)."""
    if gib > 0:
        subprocess.run([sys.executable, "-c", f"import torch; torch.ones({int(gib * 2**30)}, dtype=torch.uint8)"],
                       check=True)


def raw_read(folder: Path) -> float:
    t0 = time.perf_counter()
    for f in sorted(folder.iterdir()):
        f.read_bytes()
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--optim", default="muon", help="optim.type (adamw: two moments per parameter)")
    p.add_argument("--back-memory-gib", type=float, default=0.0,
                   help="GiB a child process writes before each timed resume and raw read (see above)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config setting of every run (repeatable), e.g. train.host_heap=system")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="resume-latency-"))
    try:
        crashed = work / "crashed"
        # Steps 1-2, checkpoint at 1 (committed in the step loop: a background save could still be
        # in flight at the crash), crash after 2.
        train(crashed, args, "--set", "checkpoint.async_save=false")
        ckpt = crashed / "checkpoints" / "step-00000001"
        nbytes = sum(f.stat().st_size for f in ckpt.iterdir())
        fresh, rows = [], {"warm": [], "cold": []}  # (startup s, restore s, raw read s) per round
        for i in range(args.repeat):
            fresh.append(train(work / f"fresh-{i}", args, "--set", "debug.crash_at_step=1")["startup_s"])
            for cache, pairs in rows.items():
                copy = work / f"resumed-{cache}-{i}"
                shutil.copytree(crashed, copy)
                # The raw read has a copy of its own: on a virtual disk the first read of new
                # bytes after eviction is the slowest (the host caches what its guest read), so a
                # resume and a raw read of the same files would favour whichever came second.
                raw_copy = shutil.copytree(ckpt, work / f"raw-{cache}-{i}")
                # Written back now, not during a timed resume or read (the kernel flushes dirty
                # pages ~30 s later: in the middle of the next cold resume), and clean, so that
                # `evict` can drop its pages at all.
                os.sync()
                folder = copy / "checkpoints" / "step-00000001"
                prepare = evict if cache == "cold" else raw_read

                def read(prepare=prepare, raw_copy=raw_copy) -> float:
                    prepare(raw_copy)
                    back_memory(args.back_memory_gib)
                    return raw_read(raw_copy)

                def resume(prepare=prepare, folder=folder, copy=copy) -> dict:
                    prepare(folder)
                    back_memory(args.back_memory_gib)
                    return train(copy, args)

                if i % 2:
                    read_s, start = read(), resume()
                else:
                    start, read_s = resume(), read()
                pairs.append((start["startup_s"], start["restore_s"], read_s, start["build_s"], start["rss_bytes"]))
                shutil.rmtree(copy)
                shutil.rmtree(raw_copy)
        f = statistics.median(fresh)
        print(f"checkpoint size        {nbytes / 2**20:8.1f} MiB")
        print(f"fresh start -> ready   {f:8.3f} s")
        for cache, pairs in rows.items():
            r = statistics.median(p[0] for p in pairs)
            ratios = [p[1] / p[2] for p in pairs]
            build, restore = statistics.median(p[3] for p in pairs), statistics.median(p[1] for p in pairs)
            print(f"{cache}: resume -> ready {r:6.3f} s (start-to-ready overhead {r - f:6.3f} s); "
                  f"restore {restore:6.3f} s, raw read "
                  f"{statistics.median(p[2] for p in pairs):6.3f} s; restore / raw read per round: median "
                  f"{statistics.median(ratios):5.2f} x, range {min(ratios):.2f}-{max(ratios):.2f} (target <= 1.2)")
            print(f"{cache}: start of the resume: build {build:6.3f} s, restore {restore:6.3f} s, the rest (imports, "
                  f"config, data) {r - build - restore:6.3f} s; resident when ready "
                  f"{max(p[4] for p in pairs) / 2**20:.0f} MiB against a checkpoint of {nbytes / 2**20:.0f} MiB")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
