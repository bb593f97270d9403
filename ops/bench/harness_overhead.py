"""The harness's own tax: a config's training steps in a bare PyTorch loop against the same steps
through `harness train` with its defaults.

Both contenders train one config (`--config`, default configs/quickstart.toml; a task's, such as
examples/image_classifier.toml, with `PYTHONPATH=examples`: model, optimizer bundle, batches,
seed) in one process each:
* bare: a nanoGPT-style loop written here: the step's micro-batches (next batch, the task's loss,
  backward), clip the gradient norm, optimizer and scheduler step, zero the gradients. It builds
  the model, optimizer bundle and batch stream through the task's own methods (harness/task) and
  the same order of samples as the harness, so both compute the same steps.
* harness: `harness train` with every default on (determinism, per-step fingerprints and the
  state hash every `train.fingerprint_every` steps, metrics.jsonl, the lease heartbeat, the
  progress bar and log lines, the checkpoint clock). Evaluation is off in both (`eval_every=0`:
  work the user asks for, not a tax) and `checkpoint.every_steps` is past the last step, so the
  cadence is checked every step but no save falls inside the timed steps (the final save comes
  after the last one is recorded).
A step's time is measured between the ends of consecutive steps (in the harness, where the loop
records a step's metrics), so it covers everything the loop does between two steps, on two
clocks: the process's CPU time (every thread: the harness's own threads count; the time other
processes take on a shared machine does not) and wall time. The figure is the mean over the
steps after `--warmup` (a mean, so periodic costs such as the state hash count). Both run with
`--threads` torch threads (1: on a shared machine more threads than free cores make OpenMP's
waits dominate). The contenders alternate, the first place swapping each round, each a fresh
process; the ratio harness / bare is taken within each round. Target: <= 1.03.
`--bare-numerics` gives the bare loop the harness's reproducibility settings too
(`harness.repro.numerics.apply`: MKL strict CNR, deterministic algorithms): the ratio is then the tax
of everything else, and the two runs together split the price of bitwise repeatability from it.
`--contender strict-cnr` puts the bare loop against itself with `MKL_CBWR=AUTO,STRICT` set
before torch loads (the harness's MKL setting, nothing else): the price of that setting alone.

Besides the median of the rounds' ratios, the ratio of the totals over all rounds and the
geometric mean of the rounds are printed: where one process's speed differs from the next by
more than the target (10% on a shared 2-core VM), a median of few rounds is mostly that noise.

    python ops/bench/harness_overhead.py --steps 110 --rounds 5 [--bare-numerics] [--contender strict-cnr]
    PYTHONPATH=examples python ops/bench/harness_overhead.py --config examples/image_classifier.toml
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "quickstart.toml"


def settings(steps: int) -> list[str]:
    """`--set` overrides both contenders run with."""
    return [f"train.steps={steps}", "train.eval_every=0", f"checkpoint.every_steps={steps * 100}"]


class StepClock:
    """(wall, process CPU) seconds at the end of each step."""

    def __init__(self) -> None:
        self.ends: list[tuple[float, float]] = []

    def tick(self) -> None:
        self.ends.append((time.perf_counter(), time.process_time()))


def bare_loop(config: Path, steps: int, clock: StepClock) -> None:
    """The nanoGPT-style loop over the config task's model, optimizer bundle and batches."""
    import torch

    from harness.config import batch_shape, load_config
    from harness.data import BatchStream
    from harness.task import TaskContext, load_task
    from optim.build import build_bundle

    cfg = load_config(config, settings(steps))
    task = load_task(cfg)
    ctx = TaskContext(args=cfg.task.args, seed=cfg.train.seed, rank=0, world_size=1, device=torch.device("cpu"),
                      steps=steps)
    data = task.data(ctx)
    torch.manual_seed(cfg.train.seed)
    model = task.models(ctx)
    opt, sched = task.optimizers(model, ctx) or build_bundle(cfg.optim, model, total_steps=cfg.train.steps)
    batch_size, accum = batch_shape(cfg, 1)
    stream = BatchStream(data.train, batch_size, cfg.train.seed, num_workers=cfg.data.num_workers,
                         collate=data.collate)
    model.train()
    clip = cfg.train.grad_clip if cfg.train.grad_clip is not None else math.inf
    for _ in range(steps):
        for _ in range(accum):
            loss = task.task.loss(model, next(stream).inputs)
            (loss / accum).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        clock.tick()
    stream.close()


def harness_loop(config: Path, steps: int, clock: StepClock, run_dir: str) -> None:
    """`harness train` in this process; the clock ticks where the loop records a step."""
    from harness.cli import main
    from harness.run.loop import Loop

    record = Loop.record

    def timed_record(loop, result) -> None:
        record(loop, result)
        clock.tick()

    Loop.record = timed_record
    argv = ["--log-level", "warning", "train", str(config), "--run-dir", run_dir]
    for s in settings(steps):
        argv += ["--set", s]
    if main(argv) != 0:
        raise SystemExit("harness train failed")


def child(mode: str, args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(args.threads)
    clock = StepClock()
    if mode == "harness":
        harness_loop(args.config, args.steps, clock, tempfile.mkdtemp(prefix="run-", dir=args.work))
    else:
        if args.bare_numerics:
            from harness.repro import numerics

            numerics.apply(args.threads)
        bare_loop(args.config, args.steps, clock)
    print(json.dumps(clock.ends))


def run_child(mode: str, args: argparse.Namespace, work: str) -> dict[str, float]:
    """Mean seconds per step after the warmup of one fresh process: {"wall": ..., "cpu": ...}."""
    env = dict(os.environ)
    env.pop("MKL_CBWR", None)
    if mode == "strict-cnr":
        env["MKL_CBWR"] = "AUTO,STRICT"  # read by MKL when it loads, before any computation
    proc = subprocess.run([sys.executable, __file__, "--child", mode, "--steps", str(args.steps),
                           "--threads", str(args.threads), "--work", work, "--config", str(args.config),
                           *(["--bare-numerics"] if args.bare_numerics else [])],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"the {mode} run failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    ends = json.loads(proc.stdout.splitlines()[-1])[args.warmup:]
    if len(ends) != args.steps - args.warmup:
        raise SystemExit(f"the {mode} run recorded {len(ends) + args.warmup} steps, expected {args.steps}")
    n = len(ends) - 1
    return {"wall": (ends[-1][0] - ends[0][0]) / n, "cpu": (ends[-1][1] - ends[0][1]) / n}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", type=Path, default=CONFIG, help="the run config both contenders train")
    p.add_argument("--steps", type=int, default=110, help="steps per run (the state hash falls on step 100)")
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the mean at the start")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch threads in both contenders")
    p.add_argument("--bare-numerics", action="store_true",
                   help="the bare loop runs under the harness's reproducibility settings too")
    p.add_argument("--contender", choices=["harness", "strict-cnr"], default="harness",
                   help="what the bare loop is measured against (see the module docstring)")
    p.add_argument("--child", choices=["bare", "harness", "strict-cnr"], help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.child, args)
        return
    args.config = args.config.resolve()
    other = args.contender
    print(f"{args.config.name}, {args.steps} steps per run (mean over the last {args.steps - args.warmup - 1}), "
          f"{args.threads} torch thread(s), {args.rounds} rounds, bare against {other}"
          + (", the bare loop under the harness's reproducibility settings" if args.bare_numerics else ""))
    rows = []
    with tempfile.TemporaryDirectory(prefix="harness-overhead-") as work:
        for r in range(args.rounds):
            order = ["bare", other] if r % 2 == 0 else [other, "bare"]
            t = {mode: run_child(mode, args, work) for mode in order}
            rows.append(t)
            print(f"round {r + 1}: CPU ms/step bare {t['bare']['cpu'] * 1e3:.1f}, {other} {t[other]['cpu'] * 1e3:.1f}, "
                  f"{other} / bare {t[other]['cpu'] / t['bare']['cpu']:.3f}; wall ms/step bare "
                  f"{t['bare']['wall'] * 1e3:.1f}, {other} {t[other]['wall'] * 1e3:.1f}, "
                  f"{other} / bare {t[other]['wall'] / t['bare']['wall']:.3f}", flush=True)
    for clock in ("cpu", "wall"):
        ratios = [t[other][clock] / t["bare"][clock] for t in rows]
        total = sum(t[other][clock] for t in rows) / sum(t["bare"][clock] for t in rows)
        geomean = math.exp(statistics.fmean(math.log(x) for x in ratios))
        print(f"median {other} / bare, {clock}: {statistics.median(ratios):.3f} "
              f"(rounds: {', '.join(f'{x:.3f}' for x in ratios)}; target <= 1.03); "
              f"all rounds together {total:.3f}, geometric mean {geomean:.3f}")


if __name__ == "__main__":
    main()
