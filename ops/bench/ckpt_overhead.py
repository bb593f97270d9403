"""Checkpoint overhead benchmark: what saving every N steps costs the step loop, sync vs async.

A model whose checkpoint is large relative to a step (default: a 49152 x 512 embedding, pooled,
then a small MLP, trained with AdamW: about 300 MB of parameters + moments, a step of a few
hundred ms on one CPU core). In one process, with the same model and state throughout, blocks of
one checkpoint interval (N steps) run in rounds of three, so that the machine's load drifts alike
over the modes and each block is compared with the `none` block next to it:
* none:  N training steps;
* sync:  N steps, then `CheckpointStore.save` (serialize, hash, write, fsync, rename);
* async: `AsyncSaver.save` (the snapshot into the reused staging buffers), N steps while the
  background thread persists, then wait for the commit if it is not done yet: one interval of a
  long run with a checkpoint every N steps, persist contention included.
Reported, as medians over rounds: the step time without checkpoints; the step-time overhead of
each mode, (block - none block of the same round) / none block; the blocking time of an async
save against the full sync save time; the background persist time; and the process CPU time per
block (all threads), which the load of other processes on the machine does not inflate.

On CUDA (`--device cuda`) the state lives on the GPU and is staged into pinned buffers on a side
stream; each step ends with a device synchronize so step times are real.

At world size 2 (`torchrun --standalone --nproc-per-node 2 ops/bench/ckpt_overhead.py`, gloo):
the model is wrapped in DDP, each rank also has a per-rank `rng` part, the sync save is the group
commit (`GroupCommit`: every rank waits until rank 0 wrote the replicated state and the
manifest) and the async save is the group's background persist (each rank stages its own part,
the commit runs on a side gloo group); the blocking time and the sync save time are reported per
rank.

Run: `python ops/bench/ckpt_overhead.py` (a few minutes on 2 CPU cores); `--json PATH` also
writes the raw figures. Results: docs/bench-async.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from harness.checkpoint import CheckpointStore, capture  # noqa: E402
from harness.checkpoint.save.async_saver import AsyncSaver  # noqa: E402
from harness.checkpoint.save.group_commit import GroupCommit  # noqa: E402
from harness.log import configure  # noqa: E402
from harness.parallel import distributed  # noqa: E402

PER_RANK = {"rng"}  # as the trainer registers it: each rank saves its own


class Pooled(nn.Module):
    """Embedding bag + MLP classifier: most of the state is one wide table with dense gradients."""

    def __init__(self, vocab: int, dim: int, classes: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, dim), nn.GELU(), nn.Linear(dim, classes))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.embed(tokens).mean(dim=1))


def make_batches(args, device: torch.device, count: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randint(args.vocab, (args.batch, args.seq), generator=g).to(device),
             torch.randint(args.classes, (args.batch,), generator=g).to(device)) for _ in range(count)]


class Bench:
    def __init__(self, args: argparse.Namespace, folder: Path) -> None:
        self.args = args
        self.device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                                   ("cpu" if args.device == "auto" else args.device))
        torch.manual_seed(0)
        self.rank = distributed.rank()
        self.model = Pooled(args.vocab, args.dim, args.classes).to(self.device)
        self.forward = torch.nn.parallel.DistributedDataParallel(self.model) if distributed.world() > 1 else self.model
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.batches = make_batches(args, self.device)
        self.i = 0
        self.sync_store = CheckpointStore(str(folder / "sync"), keep_last=2)
        self.async_store = CheckpointStore(str(folder / "async"), keep_last=2)
        self.sync_commit = GroupCommit(self.sync_store)
        side = GroupCommit(self.async_store, group=distributed.new_side_group(600))
        self.saver = AsyncSaver(side, rank=self.rank, per_rank=PER_RANK)
        self.save_s: list[float] = []
        self.blocking_s: list[float] = []
        self.persist_s: list[float] = []
        self.saver.on_commit = lambda done: self.persist_s.append(done.persist_s)

    def parts(self) -> dict:
        return {"model": self.model, "optim": self.opt, "rng": {"torch": torch.get_rng_state()}}

    def sync_save(self, step: int) -> None:
        self.sync_commit(step, capture(self.parts(), rank=self.rank, per_rank=PER_RANK))

    def step(self) -> None:
        x, y = self.batches[self.i % len(self.batches)]
        self.i += 1
        loss = nn.functional.cross_entropy(self.forward(x), y)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def block(self, mode: str, step: int) -> tuple[float, float]:
        """(wall seconds, process CPU seconds) of one checkpoint interval in `mode`."""
        cpu0, t0 = time.process_time(), time.perf_counter()
        if mode == "async":
            self.blocking_s.append(self.saver.save(step, self.parts()).blocking_s)
        for _ in range(self.args.every):
            self.step()
        if mode == "sync":
            s0 = time.perf_counter()
            self.sync_save(step)
            self.save_s.append(time.perf_counter() - s0)
        if mode == "async":
            self.saver.finish()
        return time.perf_counter() - t0, time.process_time() - cpu0

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.model.state_dict().values()) + sum(
            t.numel() * t.element_size() for s in self.opt.state.values() for t in s.values() if torch.is_tensor(t))


def run(args: argparse.Namespace) -> dict:
    configure("warning")  # one "checkpoint committed" line per save would drown the table
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp, distributed.process_group(args.device):
        b = Bench(args, Path(distributed.broadcast_object(tmp)))  # every rank writes into rank 0's folder
        for _ in range(3):  # warm up: allocator, optimizer state, page cache, first-time buffers
            b.step()
        b.sync_save(0)
        b.saver.save(0, b.parts())
        b.saver.finish()
        for figures in (b.save_s, b.blocking_s, b.persist_s):
            figures.clear()
        wall: dict[str, list[float]] = {"none": [], "sync": [], "async": []}
        cpu: dict[str, list[float]] = {"none": [], "sync": [], "async": []}
        for r in range(args.rounds):
            for mode in ("none", "sync", "async"):
                w, c = b.block(mode, (r + 1) * 10)
                wall[mode].append(w)
                cpu[mode].append(c)
            if b.rank == 0:
                print(f"round {r + 1}/{args.rounds}: " + "  ".join(f"{m} {wall[m][-1]:6.2f} s" for m in wall),
                      file=sys.stderr, flush=True)
        med = statistics.median
        per_rank = distributed.all_gather_object((med(b.save_s), med(b.blocking_s), med(b.persist_s)))
        overhead = {m: med((x - n) / n for x, n in zip(wall[m], wall["none"], strict=True)) for m in ("sync", "async")}
        cpu_overhead = {m: med((x - n) / n for x, n in zip(cpu[m], cpu["none"], strict=True))
                        for m in ("sync", "async")}
        return {
            "device": str(b.device), "threads": args.threads, "state_mb": b.nbytes() / 1e6, "every": args.every,
            "rounds": args.rounds, "step_s": med(wall["none"]) / args.every,
            "sync_overhead": overhead["sync"], "async_overhead": overhead["async"],
            "sync_cpu_overhead": cpu_overhead["sync"], "async_cpu_overhead": cpu_overhead["async"],
            "sync_save_s": med(b.save_s), "async_blocking_s": med(b.blocking_s),
            "async_persist_s": med(b.persist_s), "blocking_vs_sync": med(b.blocking_s) / med(b.save_s),
            "block_wall_s": wall, "block_cpu_s": cpu, "world_size": distributed.world(), "rank": b.rank,
            "per_rank": [{"sync_save_s": s, "async_blocking_s": bl, "async_persist_s": p} for s, bl, p in per_rank],
        }


def report(r: dict, command: str) -> str:
    pct = lambda x: f"{100 * x:.1f}%"  # noqa: E731
    return "\n".join([
        f"`{command}`", "",
        f"state {r['state_mb']:.0f} MB on {r['device']} ({r['threads']} training thread(s)); a checkpoint every "
        f"{r['every']} steps; {r['rounds']} rounds; medians; step {1000 * r['step_s']:.0f} ms without checkpoints.", "",
        "| mode | step-time overhead (wall) | CPU time overhead (all threads) |",
        "|------|--------------------------:|--------------------------------:|",
        f"| sync save every {r['every']} steps | {pct(r['sync_overhead'])} | {pct(r['sync_cpu_overhead'])} |",
        f"| async save every {r['every']} steps | {pct(r['async_overhead'])} | {pct(r['async_cpu_overhead'])} |",
        "",
        "| save | seconds |",
        "|------|--------:|",
        f"| sync save, full (serialize + hash + write + fsync + rename) | {r['sync_save_s']:.3f} |",
        f"| async save, blocking (snapshot into the staging buffers) | {r['async_blocking_s']:.3f} "
        f"({pct(r['blocking_vs_sync'])} of sync) |",
        f"| async save, background persist | {r['async_persist_s']:.3f} |",
        *per_rank_table(r),
    ])


def per_rank_table(r: dict) -> list[str]:
    """At world size > 1: what a save blocks each rank for, sync (the group commit) vs async."""
    if r["world_size"] == 1:
        return []
    rows = [f"| {i} | {x['sync_save_s']:.3f} | {x['async_blocking_s']:.3f} | "
            f"{100 * x['async_blocking_s'] / x['sync_save_s']:.1f}% | {x['async_persist_s']:.3f} |"
            for i, x in enumerate(r["per_rank"])]
    return ["", f"world size {r['world_size']} (gloo, DDP):", "",
            "| rank | sync save, blocking (s) | async save, blocking (s) | async / sync | async persist (s) |",
            "|-----:|------------------------:|-------------------------:|-------------:|------------------:|", *rows]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--classes", type=int, default=256)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--every", type=int, default=10, help="checkpoint every N steps (one block)")
    p.add_argument("--rounds", type=int, default=7, help="rounds of (none, sync, async) blocks")
    p.add_argument("--threads", type=int, default=1, help="torch threads for training (the persist uses another core)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dir", default=None, help="where the checkpoints go (default: the system temp dir)")
    p.add_argument("--json", default=None, help="also write the raw figures here")
    args = p.parse_args()
    r = run(args)
    if r["rank"] != 0:
        return
    launcher = "torchrun --standalone --nproc-per-node 2 " if r["world_size"] > 1 else "python "
    print(report(r, launcher + "ops/bench/ckpt_overhead.py " + " ".join(sys.argv[1:])))
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=1))


if __name__ == "__main__":
    main()
