"""`harness supervise [options] -- CMD ...`: run CMD under the auto-retry supervisor.

Without `--run-dir` the supervisor cannot see checkpoints, so every crash counts toward the
crash-loop limit. Exit codes: see `harness.exit_codes` (0 finished, 2 user error, 3 gave up,
75/76 preempted: requeue).
"""

from __future__ import annotations

import argparse

from harness.cli.args import check_restart_args
from harness.errors import UserError
from harness.process.supervisor import Supervisor, checkpoint_progress
from harness.records.events import EventLog
from harness.records.run_files import events_url


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "supervise",
        help="run a command, restarting it after crashes (backoff, crash-loop limit)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--max-restarts", type=int, default=10, help="restarts in all (default 10)")
    p.add_argument("--crash-loop-limit", type=int, default=3,
                   help="give up after this many consecutive crashes that committed no newer "
                        "checkpoint (default 3)")
    p.add_argument("--run-dir", help="the run's checkpoint URL: progress probe and events file")
    p.add_argument("--backoff-initial", type=float, default=1.0, help="first backoff, seconds")
    p.add_argument("--backoff-max", type=float, default=60.0, help="largest backoff, seconds")
    p.add_argument("--jitter", type=float, default=1.0, help="random extra backoff, 0..JITTER s")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- then the command to run")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        raise UserError("no command to supervise: write it after `--`, e.g. "
                        "`harness supervise --run-dir runs/a -- harness train run.toml`")
    check_restart_args(args)
    return Supervisor(
        cmd,
        max_restarts=args.max_restarts,
        crash_loop_limit=args.crash_loop_limit,
        progress=checkpoint_progress(args.run_dir) if args.run_dir else lambda: None,
        backoff_initial=args.backoff_initial,
        backoff_max=args.backoff_max,
        jitter=args.jitter,
        events=EventLog(events_url(args.run_dir)) if args.run_dir else None,
    ).run()
