"""torch.compile's effect on a training step: the quickstart's steps through the harness's Trainer
eager and with `train.compile = true`, in one process, alternating.

Both trainers are built from configs/quickstart.toml (same model, optimizer bundle, batches) with
`--threads` torch threads; the compiled one first takes `--warmup` steps (compilation, excluded).
Then `--rounds` rounds each time `--steps` steps of one trainer and then of the other (the first
place swapping each round) on two clocks: process CPU time and wall time. The figure is the
median over rounds of compiled / eager per-step time (below 1: compiled is faster).
`--inductor-random` compiles with torch's default options instead of the harness's (on a CPU
the harness keeps ATen's dropout kernels, `compile_options` in harness/run/trainer.py), to measure
what that choice is worth.

    python ops/bench/compile_step.py --rounds 7 --steps 10
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def build(compiled: bool, threads: int):
    from harness.config import load_config
    from harness.run.trainer import Trainer

    return Trainer(load_config(ROOT / "configs" / "quickstart.toml",
                               [f"train.cpu_threads={threads}", f"train.compile={str(compiled).lower()}"]))


def timed(trainer, steps: int) -> tuple[float, float]:
    """(wall, CPU) seconds per step over `steps` steps."""
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        trainer.train_step()
    return (time.perf_counter() - wall) / steps, (time.process_time() - cpu) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--inductor-random", action="store_true",
                        help="compile with torch's default options (inductor's own random numbers for dropout)")
    args = parser.parse_args()
    eager, compiled = build(False, args.threads), build(True, args.threads)
    if args.inductor_random:  # torch.compile is lazy: the harness's compiled module never ran
        import torch

        compiled.net = torch.compile(compiled.model)  # what the harness compiles, with torch's default options
    t0 = time.perf_counter()
    timed(compiled, args.warmup)
    compile_s = time.perf_counter() - t0
    timed(eager, args.warmup)
    ratios = {"wall": [], "cpu": []}
    for r in range(args.rounds):
        order = [(eager, "eager"), (compiled, "compiled")][:: 1 if r % 2 == 0 else -1]
        got = {name: timed(trainer, args.steps) for trainer, name in order}
        for i, clock in enumerate(("wall", "cpu")):
            ratios[clock].append(got["compiled"][i] / got["eager"][i])
        print(f"round {r + 1}: ms/step eager wall {got['eager'][0] * 1e3:.1f} cpu {got['eager'][1] * 1e3:.1f}, "
              f"compiled wall {got['compiled'][0] * 1e3:.1f} cpu {got['compiled'][1] * 1e3:.1f}", flush=True)
    options = "torch's default options" if args.inductor_random else "the harness's options"
    print(f"quickstart, {args.threads} torch thread(s), compiled with {options}, "
          f"first {args.warmup} compiled steps (compilation) {compile_s:.1f} s")
    for clock, values in ratios.items():
        print(f"median compiled / eager, {clock}: {statistics.median(values):.3f} "
              f"(rounds: {', '.join(f'{v:.3f}' for v in values)})")


if __name__ == "__main__":
    main()
