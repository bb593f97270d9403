"""Checkpoint I/O benchmark: the harness store against raw I/O, torch.save and torch DCP.

For a model + AdamW state of about `--size-mib` (default 1024), in one run:
* save: `CheckpointStore.save` (serialize, hash, write, fsync, atomic rename) against a raw
  write + fsync of the same tensor bytes to the same folder, `torch.save` (+ fsync), and
  `torch.distributed.checkpoint.save` (single process, no process group);
* load: `CheckpointStore.load` into the live model and optimizer against a raw read of the
  checkpoint's own files (the same bytes plus their headers, on the same disk blocks) into
  preallocated memory and `torch.load(weights_only=True)`; `load store verified` is the load a
  resume does (`Verify.WHILE`: every byte hashed (BLAKE3) as it streams in), and `verify` (the
  hash pass of `harness ckpt verify` and `latest_good`) is timed on its own;
* memory: peak RSS (VmHWM) of a child process that builds the model and a fresh optimizer
  and loads the checkpoint, against a child that builds the model and optimizer state of a
  fresh start (what training holds after its first step).

Every figure is the best of `--repeat` rounds, the contenders taking turns in each round (the
disk is shared; a burst from another process then hits all of them alike). Each save writes a
new file or folder; the previous round's is deleted untimed before it. Save figures include
fsync, so they measure the disk. Loads are measured twice: cold (the files are first evicted from
the page cache with posix_fadvise, as after a restart on a new node) and warm (read again at once:
the code path). Run: `python ops/bench/ckpt_io.py --size-mib 1024`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from harness.checkpoint import CheckpointRef, CheckpointStore, Verify, load  # noqa: E402
from harness.checkpoint.tensorfile import tensor_bytes  # noqa: E402

WIDTH = 2048


def build(size_mib: int, optimizer_state: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A stack of square layers holding a third of the state; AdamW's two moments hold the rest."""
    width = WIDTH if size_mib >= 192 else 256
    layers = max(1, round(size_mib * 2**20 / 3 / (width * width * 4)))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if optimizer_state:
        for p in model.parameters():
            opt.state[p] = {"step": torch.tensor(1.0), "exp_avg": torch.randn_like(p), "exp_avg_sq": torch.rand_like(p)}
    return model, opt


def tensors_of(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    flat = {f"model/{k}": v for k, v in model.state_dict().items()}
    for i, state in enumerate(opt.state.values()):
        flat.update({f"optim/{i}/{k}": v for k, v in state.items()})
    return flat


def best(repeat: int, ops: dict[str, tuple]) -> dict[str, float]:
    """Best time of each op (name -> (fn, prepare or None)) over `repeat` rounds. The ops run in
    turn within a round, so a burst of I/O from another process hits them all alike."""
    times: dict[str, list[float]] = {name: [] for name in ops}
    for _ in range(repeat):
        for name, (fn, prepare) in ops.items():
            if prepare is not None:
                prepare()
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: min(t) for name, t in times.items()}


def drop_cache(*paths: Path) -> None:
    """Evict these (already fsynced) files from the page cache, so the next read hits the disk."""
    for path in paths:
        for f in ([path] if path.is_file() else sorted(path.rglob("*"))):
            if f.is_file():
                fd = os.open(f, os.O_RDONLY)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(fd)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_path(path: Path) -> None:
    for f in ([path] if path.is_file() else sorted(path.rglob("*"))):
        if f.is_file():
            with open(f, "rb+") as h:
                os.fsync(h.fileno())


def raw_write(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    with open(path, "wb") as f:
        for t in tensors.values():
            f.write(tensor_bytes(t))
        f.flush()
        os.fsync(f.fileno())


def raw_read(folder: Path, into: torch.Tensor) -> None:
    """Read every file of `folder`, one after the other, into `into`."""
    view = memoryview(into.numpy())
    pos = 0
    for path in sorted(folder.iterdir()):
        with open(path, "rb", buffering=0) as f:
            while got := f.readinto(view[pos:]):
                pos += got


def child(args: argparse.Namespace) -> None:
    """Runs in a fresh process: report peak RSS after `fresh` (build with optimizer state),
    `load` (build with a fresh optimizer, then load the newest checkpoint) or `load-inplace`
    (build with optimizer state, then load: every tensor is read into live storage)."""
    model, opt = build(args.size_mib, optimizer_state=args.child != "load")
    if args.child != "fresh":
        store = CheckpointStore(args.dir)
        load(store, store.list()[-1], {"model": model, "optim": opt})
        assert len(opt.state) == len(list(model.parameters()))
    print(json.dumps({"maxrss_bytes": peak_rss()}))


def peak_rss() -> int:
    """This process's peak RSS (VmHWM). Not ru_maxrss: after a vfork+exec that reports the
    parent's peak, which is the benchmark process with the whole state in memory."""
    with open("/proc/self/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    return kib * 1024


def measure(args: argparse.Namespace, folder: Path) -> dict:
    # The model and optimizer state live in measure_in_process's frame only: freed before the children run.
    r = measure_in_process(args, folder)

    def rss(kind: str) -> int:
        out = subprocess.run([sys.executable, __file__, "--child", kind, "--size-mib", str(args.size_mib),
                              "--dir", str(folder / "run")], check=True, capture_output=True, text=True).stdout
        return json.loads(out.strip().splitlines()[-1])["maxrss_bytes"]

    r["rss_fresh_bytes"], r["rss_load_bytes"] = rss("fresh"), rss("load")
    r["rss_load_inplace_bytes"] = rss("load-inplace")
    return r


def measure_in_process(args: argparse.Namespace, folder: Path) -> dict:
    """The saves, loads and verification timed in this process (the figures but peak RSS)."""
    model, opt = build(args.size_mib, optimizer_state=True)
    tensors = tensors_of(model, opt)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    parts = {"model": model, "optim": opt}
    r: dict = {"state_bytes": nbytes, "tensors": len(tensors)}

    raw, pt, dcp_dir, run = folder / "raw.bin", folder / "state.pt", folder / "dcp", folder / "run"
    import torch.distributed.checkpoint as dcp

    def dcp_save() -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "no process group": single-process use is the point here
            dcp.save(dict(tensors), checkpoint_id=str(dcp_dir))

    def fresh(path: Path):
        """Untimed: remove this contender's previous output and commit the deletion, so the
        disk's discard of the freed blocks (the fs is mounted with `discard`) is not timed
        against whoever writes next."""
        def prepare() -> None:
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
            fsync_dir(folder)
        return prepare

    r.update(best(args.repeat, {
        "save_raw_s": (lambda: raw_write(raw, tensors), fresh(raw)),
        "save_store_s": (lambda: CheckpointStore(str(run)).save(1, parts), fresh(run)),
        "save_torch_s": (lambda: (torch.save(parts_state(model, opt), pt), fsync_path(pt)), fresh(pt)),
        "save_dcp_s": (dcp_save, fresh(dcp_dir)),
    }))
    shutil.rmtree(dcp_dir, ignore_errors=True)
    store = CheckpointStore(str(run))

    ref = store.list()[-1]
    r.update(measure_loads(args.repeat, store, ref, parts, pt))
    r.update(best(args.repeat, {"verify_s": (lambda: store.verify(ref), None)}))
    raw.unlink()
    pt.unlink()
    return r


def measure_loads(repeat: int, store: CheckpointStore, ref: CheckpointRef, parts: dict, pt: Path) -> dict:
    """Cold and warm loads; the raw reader's buffer (the checkpoint's size) is freed on return."""
    ckpt = Path(ref.path)
    buffer = torch.zeros(sum(f.stat().st_size for f in ckpt.iterdir()), dtype=torch.uint8)
    r: dict = {}
    for mode, evict in (("cold", lambda p: (lambda: drop_cache(p))), ("warm", lambda p: None)):
        r.update(best(repeat, {
            f"load_raw_{mode}_s": (lambda: raw_read(ckpt, buffer), evict(ckpt)),
            f"load_store_{mode}_s": (lambda: load(store, ref, parts), evict(ckpt)),
            f"load_verified_{mode}_s": (lambda: load(store, ref, parts, verify=Verify.WHILE), evict(ckpt)),
            f"load_torch_{mode}_s": (lambda: torch.load(pt, weights_only=True), evict(pt)),
        }))
    return r


def parts_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    return {"model": model.state_dict(), "optim": opt.state_dict()}


def report(r: dict, command: str) -> str:
    gb = r["state_bytes"] / 1e9
    rate = {k: gb / v for k, v in r.items() if k.endswith("_s")}
    extra = max(r["rss_load_bytes"], r["rss_load_inplace_bytes"]) - r["rss_fresh_bytes"]
    lines = [
        f"command: {command}",
        f"state: {r['state_bytes'] / 2**30:.3f} GiB in {r['tensors']} tensors",
        "",
        "| operation | seconds | GB/s | vs raw |",
        "|---|---|---|---|",
    ]
    for op, raw_key in (("save", "save_raw_s"), ("load cold", "load_raw_cold_s"), ("load warm", "load_raw_warm_s")):
        for who in ("raw", "store", "verified", "torch", "dcp"):
            k = raw_key.replace("raw", who)
            if k in r:
                label = "store verified" if who == "verified" else who
                name = " ".join([op.split()[0], label, *op.split()[1:]])
                lines.append(f"| {name} | {r[k]:.3f} | {rate[k]:.2f} | {r[raw_key] / r[k]:.2f}x |")
    lines.append(f"| verify (BLAKE3 of every file) | {r['verify_s']:.3f} | {rate['verify_s']:.2f} | |")
    lines += [
        "",
        f"peak RSS, fresh start (model + optimizer state): {r['rss_fresh_bytes'] / 2**20:.0f} MiB",
        f"peak RSS, build (fresh optimizer) + load:       {r['rss_load_bytes'] / 2**20:.0f} MiB",
        f"peak RSS, build (optimizer state) + load:       {r['rss_load_inplace_bytes'] / 2**20:.0f} MiB",
        f"extra while loading: {extra / 2**20:.1f} MiB = {100 * extra / r['state_bytes']:.1f}% of the state",
        "",
        f"targets: save >= 0.9x raw: {r['save_raw_s'] / r['save_store_s']:.2f}x; load >= 0.9x raw: "
        f"{r['load_raw_cold_s'] / r['load_store_cold_s']:.2f}x cold, "
        f"{r['load_raw_warm_s'] / r['load_store_warm_s']:.2f}x warm; "
        f"extra memory <= 10%: {100 * extra / r['state_bytes']:.1f}%",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=1024, help="approximate state size (default 1024)")
    parser.add_argument("--repeat", type=int, default=2, help="runs per measurement; the best is reported")
    parser.add_argument("--dir", default=None, help="folder to write in (default: a temporary one under /tmp)")
    parser.add_argument("--json", action="store_true", help="print the raw figures as JSON too")
    parser.add_argument("--child", choices=["fresh", "load", "load-inplace"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.child:
        child(args)
        return
    folder = Path(tempfile.mkdtemp(prefix="ckpt-bench-", dir=args.dir))
    try:
        r = measure(args, folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print(report(r, "python ops/bench/ckpt_io.py " + " ".join(sys.argv[1:])))
    if args.json:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
