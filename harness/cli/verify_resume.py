"""`harness verify-resume CONFIG`: check that interrupting and resuming a run changes nothing
(the two runs and the verdict: harness/verify/resume_equivalence.py)."""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import tempfile
from pathlib import Path

from harness.cli.args import add_config_args
from harness.config import RunConfig, batch_shape, load_config
from harness.errors import UserError
from harness.forkserver.pool import popen_for
from harness.run.exact_mode import exact_at_every
from harness.storage.location import output_folder
from harness.verify.resume_equivalence import Verdict, __doc__ as equivalence_doc, run_pair
from harness.verify.world_equivalence import (
    DEFAULT_TOLERANCE,
    EXACT_TOLERANCE,
    WorldVerdict,
    even_points,
    refuse_what_cannot_pass,
    run_worlds,
)


def parse_world_sizes(text: str) -> list[int]:
    try:
        sizes = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected world sizes like 2,1,4") from None
    if len(sizes) < 2 or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected at least two world sizes >= 1, like 2,1")
    return sizes


def parse_steps(text: str) -> list[int]:
    try:
        steps = sorted({int(s) for s in text.split(",") if s.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected step numbers like 13,40") from None
    if not steps:
        raise argparse.ArgumentTypeError("expected at least one step")
    return steps


def positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number >= 1") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number >= 1")
    return n


def first_checkpoint(cfg: RunConfig) -> int | None:
    """The step by which B's first checkpoint is sure to exist, or None when only time tells
    (`checkpoint.every_minutes` alone: the verdict then says whether a resume was exercised).
    An interruption before it resumes from nothing and tests nothing; a config that saves only
    the final step is refused (no interruption could test a resume)."""
    c = cfg.checkpoint
    if c.every_steps == "auto":
        return 1  # "auto" saves once after the first step
    if c.every_steps:
        return c.every_steps
    if c.every_minutes:
        return None
    raise UserError("checkpoint.every_steps = 0 and checkpoint.every_minutes = 0: only the final step is saved, so "
                    "an interrupted run has nothing to resume from; set checkpoint.every_steps (--set)")


def check_points(points: list[int], first: int | None, cfg: RunConfig) -> None:
    """Refuse interruption steps before the first checkpoint (both modes)."""
    early = [p for p in points if first is not None and p < first]
    if early:
        raise UserError(f"--interrupt-at {','.join(map(str, points))}: step {early[0]} is before the first "
                        f"checkpoint (step {first}, checkpoint.every_steps = {cfg.checkpoint.every_steps!r}), so the "
                        f"resumed run would start from nothing and test no resume; interrupt at step {first} or later")


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = commands.add_parser("verify-resume", help="check that interrupting and resuming a run changes nothing",
                            description=equivalence_doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(p, run_dir=False)
    p.add_argument("--steps", type=positive_int, metavar="N", help="train N steps instead of the config's train.steps")
    points = p.add_mutually_exclusive_group()
    points.add_argument("--interrupt-at", type=parse_steps, metavar="S1,S2",
                        help="interrupt B once it logged these steps")
    points.add_argument("--random", type=int, metavar="K", help="interrupt at K random steps (default: 2)")
    p.add_argument("--seed", type=int, help="seed of --random (default: a fresh one, printed)")
    p.add_argument("--signal", choices=["KILL", "TERM"], default="KILL",
                   help="KILL: die at once, resume from the last checkpoint; TERM: preemption, save and exit")
    p.add_argument("--fingerprint-every", type=int, default=1, metavar="N",
                   help="state hash every N steps (default 1: the divergent step and part are exact)")
    p.add_argument("--world-sizes", type=parse_world_sizes, metavar="N,M[,K]",
                   help="run A at world size N and B at N, then resumed at M (and K...): the batches must be "
                        "identical, the losses and state within --tolerance (verify/world_equivalence.py); one "
                        "interruption per size after the first (--interrupt-at, default evenly spaced)")
    p.add_argument("--tolerance", type=float, metavar="X",
                   help=f"with --world-sizes: the largest deviation accepted (default {DEFAULT_TOLERANCE:g}; 0 under "
                        "parallel.exact_elastic, whose verdict is then `identical`)")
    p.add_argument("--work-dir", metavar="DIR", help="keep both runs here (default: a temporary folder, "
                                                     "removed when identical)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    overrides = list(args.overrides) + ([f"train.steps={args.steps}"] if args.steps is not None else [])
    cfg = load_config(args.config, overrides)
    steps = cfg.train.steps
    if args.tolerance is not None and not args.world_sizes:
        raise UserError("--tolerance applies to --world-sizes only: a resume at the same world size must be identical")
    first = first_checkpoint(cfg)
    if args.world_sizes:
        points = worlds_points(args, cfg)
    elif args.interrupt_at:
        points = args.interrupt_at
    else:
        seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
        k = 2 if args.random is None else args.random
        lowest = 1 if first is None else first + 1  # after the first checkpoint: one to resume from
        if not 0 < k <= steps - lowest:
            raise UserError(f"--random {k}: choose between 1 and {steps - lowest} interruptions for {steps} steps "
                            f"(steps {lowest}..{steps - 1}, after the first checkpoint)")
        points = sorted(random.Random(seed).sample(range(lowest, steps), k))
        print(f"interrupting once steps {','.join(map(str, points))} are logged (--random {k} --seed {seed})",
              flush=True)
    if points[0] < 1 or points[-1] >= steps:
        raise UserError(f"--interrupt-at {','.join(map(str, points))}: steps must lie in 1..{steps - 1}")
    check_points(points, first, cfg)

    work = Path(args.work_dir or tempfile.mkdtemp(prefix="verify-resume-"))
    output_folder(str(work), None, "--work-dir")
    sets = [*overrides, f"train.fingerprint_every={args.fingerprint_every}", 'train.on_divergence="warn"']
    sig = {"KILL": signal.SIGKILL, "TERM": signal.SIGTERM}[args.signal]
    verdict: WorldVerdict | Verdict
    with popen_for(os.environ, os.getcwd()) as popen:  # a fork server where it can: no torch import per run
        if args.world_sizes:
            default = EXACT_TOLERANCE if exact_at_every(cfg, args.world_sizes) else DEFAULT_TOLERANCE
            tolerance = default if args.tolerance is None else args.tolerance
            verdict = run_worlds(args.config, steps, work, sets, args.world_sizes, points, sig, tolerance, popen)
        else:
            verdict = run_pair(args.config, steps, work, sets, points, sig, popen)
    print(verdict, flush=True)
    if verdict and not args.work_dir:
        shutil.rmtree(work, ignore_errors=True)
    elif not verdict:
        print(f"runs kept in {work} (logs: continuous.log, interrupted.log)")
    return 0 if verdict else 1


def worlds_points(args: argparse.Namespace, cfg: RunConfig) -> list[int]:
    """The interruption steps of a --world-sizes check (one per size after the first), after
    refusing (before anything runs) a world size the config's global batch cannot split and a
    config whose check cannot pass (world_equivalence.refuse_what_cannot_pass)."""
    for world in args.world_sizes:
        batch_shape(cfg, world)
    if args.random is not None:
        raise UserError("--world-sizes interrupts once per size after the first: give those steps with "
                        "--interrupt-at, or leave them evenly spaced (without --random)")
    points = args.interrupt_at or even_points(cfg.train.steps, args.world_sizes)
    if len(points) != len(args.world_sizes) - 1:
        raise UserError(f"--interrupt-at {','.join(map(str, points))}: give {len(args.world_sizes) - 1} step(s), one "
                        f"per world size after the first of --world-sizes {','.join(map(str, args.world_sizes))}")
    refuse_what_cannot_pass(cfg, args.world_sizes, args.tolerance)
    return points
