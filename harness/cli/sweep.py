"""`harness sweep CONFIG...`: train several experiment arms one after another (how: harness/arms.py)."""

from __future__ import annotations

import argparse

from harness.cli.args import add_overrides, add_restart_args
from harness.errors import UserError
from harness.arms import __doc__ as arms_doc
from harness.arms import exit_code, format_summary, sweep


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("sweep", help="train several arms one after another (resumable)",
                              description=arms_doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("configs", nargs="+", metavar="CONFIG", help="TOML run configs, one per arm")
    add_overrides(p, "a key in every arm")
    add_restart_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.max_restarts < 0 or args.crash_loop_limit < 1:
        raise UserError("--max-restarts must be >= 0 and --crash-loop-limit >= 1")
    results = sweep(args.configs, args.overrides, max_restarts=args.max_restarts,
                    crash_loop_limit=args.crash_loop_limit)
    print(format_summary(results), flush=True)
    return exit_code(results)
