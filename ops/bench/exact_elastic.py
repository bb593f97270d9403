"""The price of `parallel.exact_elastic`: step time and bytes sent per step of exact mode against
the default reduction of DDP and of FSDP2, at the same process count (2 ranks, gloo, CPU), in the
same processes.

Every contender trains the quickstart GPT (4 layers, d_model 128, 0.8 M parameters, dropout 0.1,
Muon) with the same global batch of 16 samples in micro-batches of 4 (2 per rank per step) and
one thread per rank; each pair differs in `parallel.exact_elastic` only:
* ddp: DistributedDataParallel, accumulation under no_sync, one bucketed all-reduce per step;
  exact-ddp: per-micro-batch RNG streams, every micro-batch's gradient flattened and summed over
  the fixed tree, the hand reduce-scatter (all-to-all, local tree sum) and an all-gather, an
  all-reduce of a byte per parameter (which got a gradient), the clipping norm from exactly
  summed row sums (harness/parallel/exact.py);
* fsdp: FSDP2, its reduce-scatter on the last micro-batch; exact-fsdp: the same tree, the
  all-to-all into FSDP's row shards, no all-gather (harness/parallel/exact_fsdp.py), the row sums of the
  clipping norm all-gathered.
Each round builds a fresh trainer per contender, the order reversed every round, runs 2 warm-up
steps, then `--steps` timed ones; a contender's figure is the median step time of the round (a
step as `StepResult.seconds` counts it: data, forward, backward, reduction, optimizer), and each
ratio exact / default is taken within a round (the shared machine's load moves between minutes).
Bytes are what one rank sends per step through the gradient and loss collectives, counted by
wrapping them (exact mode's in harness.parallel.exact and harness.parallel.exact_fsdp, FSDP's reduce-scatter in
its collectives module, DDP's with a comm hook around its all-reduce), as the algorithms gloo
uses move them: a ring all-reduce sends 2 (W - 1) / W of its buffer, a ring all-gather (W - 1)
times its input, an all-to-all and a reduce-scatter (W - 1) / W of theirs. Not counted, the same
in both modes: FSDP's parameter all-gathers, and the default modes' 4-byte loss all-reduce and
FSDP's norm all-reduce.

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
CONTENDERS = ("ddp", "exact-ddp", "fsdp", "exact-fsdp")


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

    from harness.parallel import distributed
    from harness.repro import numerics

    numerics.prepare_environment()
    with distributed.process_group("cpu") as topo, tempfile.TemporaryDirectory() as tmp:
        sent = Counter(topo.world_size)
        sent.wrap_collectives()
        rows = []
        for r in range(args.rounds):
            order = CONTENDERS if r % 2 == 0 else CONTENDERS[::-1]
            row = {name: measure(name, args, topo, Path(tmp) / f"{name}-{r}", sent) for name in order}
            rows.append(row)
            if topo.rank == 0:
                print(f"round {r + 1} ({', '.join(order)}): step ms "
                      + ", ".join(f"{name} {row[name][0] * 1e3:.1f}" for name in CONTENDERS)
                      + "; exact / default " + ", ".join(f"{base} {row['exact-' + base][0] / row[base][0]:.3f}"
                                                         for base in ("ddp", "fsdp")), flush=True)
        if topo.rank == 0:
            for base in ("ddp", "fsdp"):
                ratios = [row[f"exact-{base}"][0] / row[base][0] for row in rows]
                default, exact = rows[0][base][1], rows[0][f"exact-{base}"][1]
                print(f"exact-{base} / {base} step time: median {statistics.median(ratios):.3f} (rounds: "
                      f"{', '.join(f'{x:.3f}' for x in ratios)}); bytes sent per rank per step {base} {default:,}, "
                      f"exact-{base} {exact:,} ({exact / default:.3f}x)", flush=True)
    return 0


def measure(name: str, args: argparse.Namespace, topo, run_dir: Path, sent: Counter) -> tuple[float, int]:
    """(median step seconds, bytes this rank sent per step) of one contender's fresh trainer."""
    from harness.config import load_config
    from harness.run.trainer import Trainer

    exact, strategy = name.startswith("exact-"), name.removeprefix("exact-")
    cfg = load_config(CONFIG, [*SETS, f"parallel.exact_elastic={str(exact).lower()}", f"parallel.strategy={strategy}",
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

    def wrap_collectives(self) -> None:
        """Count what exact mode and FSDP send through the `dist` their modules call."""
        import torch.distributed as real
        from torch.distributed.fsdp._fully_shard import _fsdp_collectives

        import harness.parallel.exact as exact
        import harness.parallel.exact_fsdp as exact_fsdp

        counter = self

        class Counted:
            def __getattr__(self, attr):
                return getattr(real, attr)

            def all_to_all_single(self, output, input, *a, **k):
                counter.total += input.numel() * input.element_size() * (counter.world - 1) // counter.world
                return real.all_to_all_single(output, input, *a, **k)

            def all_gather(self, outputs, input, *a, **k):
                counter.total += input.numel() * input.element_size() * (counter.world - 1)
                return real.all_gather(outputs, input, *a, **k)

            def all_reduce(self, tensor, *a, **k):  # exact mode's flags of the parameters with a gradient
                counter.total += 2 * (counter.world - 1) * tensor.numel() * tensor.element_size() // counter.world
                return real.all_reduce(tensor, *a, **k)

            def reduce_scatter_single(self, output, input, *a, **k):
                counter.total += input.numel() * input.element_size() * (counter.world - 1) // counter.world
                return real.reduce_scatter_single(output, input, *a, **k)

        exact.dist = exact_fsdp.dist = _fsdp_collectives.dist = Counted()

    def hook_ddp(self, ddp) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        def counted(state, bucket):
            buffer = bucket.buffer()
            self.total += 2 * (self.world - 1) * buffer.numel() * buffer.element_size() // self.world
            return allreduce_hook(state, bucket)

        ddp.register_comm_hook(None, counted)


if __name__ == "__main__":
    sys.exit(main())
