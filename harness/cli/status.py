"""`harness status RUN_DIR [--watch [SECONDS]]`: one screen on a running or stopped run
(harness/health/run_status.py renders it from the run's logs).

`--watch` started before the run has written its first event waits for it (saying so once on
stderr). On a terminal each refresh redraws the screen in place; into a pipe or file each is
printed after the last, without escape codes.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from harness.errors import UserError
from harness.health.run_status import render
from harness.records.events import EVENTS_FILE
from harness.records.run_files import log_dir_for, refuse_a_file

CLEAR = "\033[H\033[2J"  # cursor home, clear the screen


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("status", help="one screen on a running or stopped run: step, speed, ETA, "
                                             "checkpoint, restarts, anomalies", description=__doc__)
    p.add_argument("run_dir", help="the run dir (URL) given to `harness train`")
    p.add_argument("--log-dir", help="the run's log_dir, when it was set in its config")
    p.add_argument("--watch", type=float, nargs="?", const=5.0, metavar="SECONDS",
                   help="redraw every SECONDS (default 5) until Ctrl-C")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    refuse_a_file(args.run_dir)
    log_dir = Path(log_dir_for(args.run_dir, args.log_dir))
    if args.watch is None:
        print(render(args.run_dir, log_dir))
        return 0
    if args.watch <= 0:
        raise UserError(f"--watch {args.watch}: give a positive number of seconds between redraws")
    in_place = sys.stdout.isatty()
    try:
        if not (log_dir / EVENTS_FILE).exists():
            print(f"waiting for the run to start: no {log_dir / EVENTS_FILE} yet (Ctrl-C to stop)",
                  file=sys.stderr, flush=True)
            while not (log_dir / EVENTS_FILE).exists():
                time.sleep(args.watch)
        while True:
            screen = render(args.run_dir, log_dir)
            sys.stdout.write(CLEAR + screen + "\n" if in_place else screen + "\n\n")
            sys.stdout.flush()
            time.sleep(args.watch)
    except KeyboardInterrupt:
        return 0
