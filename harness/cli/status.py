"""`harness status RUN_DIR [--watch [SECONDS]]`: one screen on a running or stopped run
(harness/health/status.py renders it from the run's logs)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from harness.errors import UserError
from harness.run.files import log_dir_for
from harness.health.status import render


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("status", help="one screen on a running or stopped run: step, speed, ETA, "
                                             "checkpoint, restarts, anomalies", description=__doc__)
    p.add_argument("run_dir", help="the run dir (URL) given to `harness train`")
    p.add_argument("--log-dir", help="the run's log_dir, when it was set in its config")
    p.add_argument("--watch", type=float, nargs="?", const=5.0, metavar="SECONDS",
                   help="redraw every SECONDS (default 5) until Ctrl-C")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    log_dir = Path(log_dir_for(args.run_dir, args.log_dir))
    if args.watch is None:
        print(render(args.run_dir, log_dir))
        return 0
    if args.watch <= 0:
        raise UserError(f"--watch {args.watch}: give a positive number of seconds between redraws")
    try:
        while True:
            screen = render(args.run_dir, log_dir)
            sys.stdout.write("\033[H\033[2J" + screen + "\n")  # home, clear: redraw in place
            sys.stdout.flush()
            time.sleep(args.watch)
    except KeyboardInterrupt:
        return 0
