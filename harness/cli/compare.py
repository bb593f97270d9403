"""`harness compare RUN_DIR... [--plot out.png]`: a table of arms and a plot of their loss curves,
or, for runs over seeds and lrs, mean and spread per arm and lr and each arm's best lr (the
columns and the plots: harness/experiments/comparison.py, harness/experiments/sweep_report.py)."""

from __future__ import annotations

import argparse
import sys

from harness.errors import UserError
from harness.experiments.comparison import __doc__ as compare_doc, format_table, run_dirs_of, summarize, write_plot
from harness.experiments.seed_groups import group_runs
from harness.experiments.sweep_report import format_best, format_by_lr, write_sweep_plot


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("compare", help="table and plot of several runs (arms, seeds, lr sweeps)",
                              description=compare_doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                   help="run dirs given to `harness train`/`sweep`, or a grid's sweep dir (its runs)")
    p.add_argument("--plot", metavar="OUT.png", help="also write a PNG: loss vs step and vs wall time; for "
                   "grouped runs, each arm's best-lr curve with its seed band and final loss vs lr")
    p.add_argument("--target-loss", type=float, metavar="LOSS",
                   help="grouped runs: also report the steps each arm's runs took to reach this eval loss")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    runs = [summarize(run_dir) for given in args.run_dirs for run_dir in run_dirs_of(given)]
    arms = group_runs(runs)
    grouped = any(len(a.groups) > 1 or len(g.runs) > 1 for a in arms for g in a.groups)
    if args.target_loss is not None and not grouped:
        raise UserError("--target-loss applies to grouped runs (an arm's seeds or lrs, as `harness sweep` makes "
                        "them); these runs are one per arm: drop it, or give the runs of a sweep")
    if grouped:
        print("By lr (mean over seeds; * = the arm's best lr by mean final eval loss):\n"
              + format_by_lr(arms, args.target_loss)
              + "\n\nEach arm at its best lr:\n" + format_best(arms, args.target_loss), flush=True)
    else:
        print(format_table(runs), flush=True)
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UserError(f"matplotlib is not installed, so no plot was written to {args.plot}; "
                            "install it with `pip install 'harness[plot]'` (the table is above)") from None
        try:
            if grouped:
                write_sweep_plot(arms, args.plot)
            else:
                write_plot(runs, args.plot)
        except OSError as e:  # the plot only writes args.plot: a missing or read-only folder
            raise UserError(f"cannot write the plot to --plot {args.plot}: {e}; choose a writable "
                            "path (the table is above)") from None
        print(f"plot: {args.plot}", file=sys.stderr)
    return 0
