"""The local checkpoint tier at scale, two ranks: tmpfs saves in the background and peer copies.

Run under torchrun on one machine (gloo: the peer copies cross loopback, not a network):

    torchrun --standalone --nproc-per-node 2 ops/bench/scale_local.py --sizes 0.5,1 [--cap-mib 256]

Each rank holds `--sizes` GiB of state (ops/bench/scale.py's: float32 tensors of 16 MiB in a
"model" and an "optim" part) and saves it `--saves` times to the local tier in `--dir` (a tmpfs by
default: a RAM tier) as a training process does: in the background through the persistent saver's
staging memory (`LocalTier.save_like` an `AsyncSaver`), each save's files then sent to the other
rank (peer_jump 1) in messages of `peer_copies.CHUNK_BYTES` and committed in its peer folder. Per
rank, with the default staging ring (the state's size) and with `--cap-mib`:
* blocking: the seconds each save holds the step loop (the copy into the ring), median;
* saved + copied: from the save's start until its local commit and its peer copy are both done;
* RAM: the peak resident memory during the saves minus the resident memory of the state alone
  (what a rank needs beyond its state: the ring, the exchange's messages, the hash backlog), and
  the bytes the rank's tmpfs folders hold at the end (its own checkpoints and its peer's copies,
  `keep` = 2 of each; in RAM too on a tmpfs, but the page cache's, not the process's).
Both ranks run on this machine's two cores at once, so each save's copy, write and hash share them.
"""

from __future__ import annotations

import argparse
import gc
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness.checkpoint import CheckpointStore  # noqa: E402
from harness.checkpoint.save.async_saver import AsyncSaver  # noqa: E402
from harness.checkpoint.save.commit import Committer  # noqa: E402
from harness.checkpoint.save.local_tier import LocalTier  # noqa: E402
from harness.config import LocalTierSection  # noqa: E402
from harness.log import configure  # noqa: E402
from harness.parallel import distributed  # noqa: E402
from harness.process import process_end  # noqa: E402
from scale import GIB, PeakRss, rss, state_of, tensors_of  # noqa: E402

RUN = "scale-local"


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def measure(parts, root: Path, cap: int | None, saves: int) -> dict:
    """`saves` local saves of `parts` with peer copies, each waited for before the next."""
    gc.collect()  # the savers of an earlier measure (their references form cycles) hold no ring now
    before = rss()
    persistent = AsyncSaver(Committer(CheckpointStore(str(root / "run"))), staging_bytes=cap)
    tier = LocalTier(LocalTierSection(dir=str(root / "local"), every_steps=1, keep=2, peer_jump=1), RUN,
                     resumed_step=0)
    tier.save_like(persistent)
    tier.prepare(parts)
    ring = persistent.ring.nbytes  # waits for the allocation: the step loop prepares long before a save
    blocking, done = [], []
    with PeakRss() as peak:
        for step in range(1, saves + 1):
            distributed.barrier()
            t0 = time.perf_counter()
            blocking.append(tier.save(step, parts, {}).blocking_s)
            tier.finish()  # committed here and copied to the peer
            done.append(time.perf_counter() - t0)
    distributed.barrier()
    held = folder_bytes(root / "local" / RUN)
    tier.close()
    del tier, persistent
    gc.collect()
    return {"blocking": statistics.median(blocking), "done": statistics.median(done), "rss": peak.peak - before,
            "ring": ring, "held": held}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="0.5,1", help="GiB of state per rank, comma-separated")
    p.add_argument("--cap-mib", type=int, default=256)
    p.add_argument("--saves", type=int, default=3)
    p.add_argument("--dir", default="/dev/shm")
    args = p.parse_args()
    configure("warning")
    with distributed.process_group("cpu"):
        rank = distributed.rank()
        for gib in (float(s) for s in args.sizes.split(",")):
            parts = state_of(gib)
            size = sum(t.numel() * 4 for t in tensors_of(parts)) / GIB
            rows = {}
            for name, cap in (("default ring", None), (f"cap {args.cap_mib} MiB", args.cap_mib << 20)):
                root = Path(tempfile.mkdtemp(dir=args.dir, prefix=f"scale-local-{rank}-"))
                try:
                    rows[name] = measure(parts, root, cap, args.saves)
                finally:
                    shutil.rmtree(root, ignore_errors=True)
            gathered = [None] * distributed.world()
            dist.all_gather_object(gathered, rows)
            if rank == 0:
                report(size, args, gathered)
            del parts


def report(size: float, args: argparse.Namespace, gathered: list[dict]) -> None:
    print(f"{size:.2f} GiB of state per rank, {len(gathered)} ranks, {args.saves} local saves each to {args.dir} "
          f"with peer copies:")
    for rank, rows in enumerate(gathered):
        for name, r in rows.items():
            print(f"  rank {rank}, {name}: blocking {r['blocking']:.3f} s ({r['blocking'] / size:.3f} s/GiB); saved + "
                  f"copied to the peer {r['done']:.2f} s; RAM beyond the state {r['rss'] / 2**20:.0f} MiB (ring "
                  f"{r['ring'] / 2**20:.0f} MiB); tmpfs held {r['held'] / GIB:.2f} GiB (own + peer copies)")


if __name__ == "__main__":
    main()
    process_end.end(0)  # a process that joined a group ends this way (harness/process/process_end.py)
