"""The price of `parallel.exact_elastic`: step time and bytes sent per step of exact mode against
DDP's own reduction, at the same process count (2 ranks, gloo, CPU), in the same processes.

Both contenders train the quickstart GPT (4 layers, d_model 128, 0.8 M parameters, dropout 0.1,
Muon) with the same global batch of 16 samples in micro-batches of 4 (2 per rank per step) and
one thread per rank; they differ in `parallel.exact_elastic` only:
* ddp: DistributedDataParallel, accumulation under no_sync, one bucketed all-reduce per step;
* exact: per-micro-batch RNG streams, every micro-batch's gradient flattened and summed over the
  fixed tree, then the hand reduce-scatter (all-to-all, local tree sum) and all-gather
  (harness/exact.py).
Each round builds a fresh trainer per contender, alternating which goes first, runs 2 warm-up
steps, then `--steps` timed ones; a contender's figure is the median step time of the round (a
step as `StepResult.seconds` counts it: data, forward, backward, reduction, optimizer), and the
ratio exact / ddp is taken within each round (the shared machine's load moves between minutes).
Bytes are what one rank sends per step through each collective, counted by wrapping them (the
exact mode's in harness.exact, DDP's with a comm hook around its all-reduce), as the algorithms
gloo uses move them: a ring all-reduce sends 2 (W - 1) / W of its buffer, a ring all-gather
(W - 1) times its input, an all-to-all (W - 1) / W of its input.

    python ops/bench/exact_elastic.py [--rounds 3] [--steps 10] [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "quickstart.toml"
SETS = ["train.global_batch=16", "data.batch_size=4", "train.grad_accum=null", "train.cpu_threads=1",
        "train.eval_every=0", "train.device=cpu"]
WARMUP = 2


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=10, help="timed steps per contender per round")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(Path(__file__).resolve()), "--worker", "--rounds", str(args.rounds), "--steps", str(args.steps),
           *[a for s in args.sets for a in ("--set", s)]]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    return subprocess.run(cmd, cwd=ROOT, env=env).returncode


def worker(args: argparse.Namespace) -> int:
    import tempfile

    from harness import distributed, numerics

    numerics.prepare_environment()
    with distributed.process_group() as topo, tempfile.TemporaryDirectory() as tmp:
        sent = Counter(topo.world_size)
        sent.wrap_exact()
        rows = []
        for r in range(args.rounds):
            order = ["ddp", "exact"] if r % 2 == 0 else ["exact", "ddp"]
            row = {name: measure(name, args, topo, Path(tmp) / f"{name}-{r}", sent) for name in order}
            rows.append(row)
            if topo.rank == 0:
                print(f"round {r + 1} ({' first, '.join(order)} second): step ms ddp {row['ddp'][0] * 1e3:.1f}, "
                      f"exact {row['exact'][0] * 1e3:.1f}, exact / ddp {row['exact'][0] / row['ddp'][0]:.3f}; "
                      f"bytes sent per rank per step ddp {row['ddp'][1]:,}, exact {row['exact'][1]:,}", flush=True)
        if topo.rank == 0:
            ratios = [row["exact"][0] / row["ddp"][0] for row in rows]
            print(f"exact / ddp step time: median {statistics.median(ratios):.3f} "
                  f"(rounds: {', '.join(f'{x:.3f}' for x in ratios)}); bytes sent per rank per step: ddp "
                  f"{rows[0]['ddp'][1]:,}, exact {rows[0]['exact'][1]:,} "
                  f"(exact / ddp {rows[0]['exact'][1] / rows[0]['ddp'][1]:.3f})", flush=True)
    return 0


def measure(name: str, args: argparse.Namespace, topo, run_dir: Path, sent: Counter) -> tuple[float, int]:
    """(median step seconds, bytes this rank sent per step) of one contender's fresh trainer."""
    from harness.config import load_config
    from harness.trainer import Trainer

    cfg = load_config(CONFIG, [*SETS, f"parallel.exact_elastic={'true' if name == 'exact' else 'false'}",
                               f"run_dir={str(run_dir)!r}", *args.sets])
    trainer = Trainer(cfg, rank=topo.rank, world_size=topo.world_size, fresh=True)
    if name == "ddp":
        sent.hook_ddp(trainer.net)
    for _ in range(WARMUP):
        trainer.train_step()
    sent.total = 0
    seconds = [trainer.train_step().seconds for _ in range(args.steps)]
    per_step = sent.total // args.steps
    trainer.close()
    return statistics.median(seconds), per_step


class Counter:
    """Bytes this rank sends through the step's gradient and loss collectives (module docstring)."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.total = 0

    def wrap_exact(self) -> None:
        import harness.exact as exact

        real = exact.dist

        class Counted:
            def __getattr__(_, attr):
                return getattr(real, attr)

            def all_to_all_single(_, output, input, *a, **k):
                self.total += input.numel() * input.element_size() * (self.world - 1) // self.world
                return real.all_to_all_single(output, input, *a, **k)

            def all_gather(_, outputs, input, *a, **k):
                self.total += input.numel() * input.element_size() * (self.world - 1)
                return real.all_gather(outputs, input, *a, **k)

        exact.dist = Counted()

    def hook_ddp(self, ddp) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        def counted(state, bucket):
            buffer = bucket.buffer()
            self.total += 2 * (self.world - 1) * buffer.numel() * buffer.element_size() // self.world
            return allreduce_hook(state, bucket)

        ddp.register_comm_hook(None, counted)


if __name__ == "__main__":
    sys.exit(main())
