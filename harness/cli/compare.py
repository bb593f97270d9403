"""`harness compare RUN_DIR... [--plot out.png]`: a table of arms and a plot of their loss curves
(the columns and the plot: harness/compare.py)."""

from __future__ import annotations

import argparse
import sys

from harness.compare import __doc__ as compare_doc
from harness.compare import format_table, summarize, write_plot
from harness.errors import UserError


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("compare", help="table and plot of several runs (arms)", description=compare_doc,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run dirs given to `harness train`/`sweep`")
    p.add_argument("--plot", metavar="OUT.png", help="also write a PNG: loss vs step and vs wall time")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    arms = [summarize(run_dir) for run_dir in args.run_dirs]
    print(format_table(arms), flush=True)
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UserError(f"matplotlib is not installed, so no plot was written to {args.plot}; "
                            "install it with `pip install 'harness[plot]'` (the table is above)") from None
        write_plot(arms, args.plot)
        print(f"plot: {args.plot}", file=sys.stderr)
    return 0
