"""`harness verify-resume CONFIG`: check that interrupting and resuming a run changes nothing
(the two runs and the verdict: harness/resume_equivalence.py)."""

from __future__ import annotations

import argparse
import random
import shutil
import signal
import tempfile
from pathlib import Path

from harness.cli.args import add_config_args
from harness.config import load_config
from harness.errors import UserError
from harness.resume_equivalence import __doc__ as equivalence_doc
from harness.resume_equivalence import run_pair


def parse_steps(text: str) -> list[int]:
    try:
        steps = sorted({int(s) for s in text.split(",") if s.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected step numbers like 13,40") from None
    if not steps:
        raise argparse.ArgumentTypeError("expected at least one step")
    return steps


def register(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("verify-resume", help="check that interrupting and resuming a run changes nothing",
                            description=equivalence_doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(p, run_dir=False)
    p.add_argument("--steps", type=int, metavar="N", help="train N steps instead of the config's train.steps")
    points = p.add_mutually_exclusive_group()
    points.add_argument("--interrupt-at", type=parse_steps, metavar="S1,S2", help="interrupt B once it logged these steps")
    points.add_argument("--random", type=int, metavar="K", help="interrupt at K random steps (default: 2)")
    p.add_argument("--seed", type=int, help="seed of --random (default: a fresh one, printed)")
    p.add_argument("--signal", choices=["KILL", "TERM"], default="KILL",
                   help="KILL: die at once, resume from the last checkpoint; TERM: preemption, save and exit")
    p.add_argument("--fingerprint-every", type=int, default=1, metavar="N",
                   help="state hash every N steps (default 1: the divergent step and part are exact)")
    p.add_argument("--work-dir", metavar="DIR", help="keep both runs here (default: a temporary folder, "
                                                     "removed when identical)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    overrides = list(args.overrides) + ([f"train.steps={args.steps}"] if args.steps else [])
    steps = load_config(args.config, overrides).train.steps
    if args.interrupt_at:
        points = args.interrupt_at
    else:
        seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
        k = 2 if args.random is None else args.random
        if not 0 < k < steps:
            raise UserError(f"--random {k}: choose between 1 and {steps - 1} interruptions for {steps} steps")
        points = sorted(random.Random(seed).sample(range(1, steps), k))
        print(f"interrupting once steps {','.join(map(str, points))} are logged (--random {k} --seed {seed})", flush=True)
    if points[0] < 1 or points[-1] >= steps:
        raise UserError(f"--interrupt-at {','.join(map(str, points))}: steps must lie in 1..{steps - 1}")

    work = Path(args.work_dir or tempfile.mkdtemp(prefix="verify-resume-"))
    work.mkdir(parents=True, exist_ok=True)
    sets = [*overrides, f"train.fingerprint_every={args.fingerprint_every}", 'train.on_divergence="warn"']
    sig = {"KILL": signal.SIGKILL, "TERM": signal.SIGTERM}[args.signal]
    verdict = run_pair(args.config, steps, work, sets, points, sig)
    print(verdict, flush=True)
    if verdict and not args.work_dir:
        shutil.rmtree(work, ignore_errors=True)
    elif not verdict:
        print(f"runs kept in {work} (logs: continuous.log, interrupted.log)")
    return 0 if verdict else 1
