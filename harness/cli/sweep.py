"""`harness sweep CONFIG... [--grid KEY=V1,V2] [--seeds S1,S2]`: train arms and grids of runs one
after another, or print them for a cluster (how: harness/experiments/arms.py, harness/experiments/grid.py)."""

from __future__ import annotations

import argparse

from harness.cli.args import add_overrides, add_restart_args, check_restart_args
from harness.experiments.arms import (
    __doc__ as arms_doc,
    command_lines,
    exit_code,
    format_summary,
    plan,
    slurm_array,
    sweep,
)
from harness.experiments.grid import parse_axes


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("sweep", help="train arms and grids of runs one after another (resumable)",
                              description=arms_doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("configs", nargs="+", metavar="CONFIG", help="TOML run configs, one per arm")
    add_overrides(p, "a key in every run")
    p.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2,...",
                   help="vary a config key over these values (repeatable: several grids multiply), "
                        "e.g. --grid optim.lr=1e-3,3e-3,1e-2; runs go under each config's run_dir")
    p.add_argument("--seeds", metavar="S1,S2,...", help="the train.seed axis of the grid, e.g. --seeds 0,1,2")
    how = p.add_mutually_exclusive_group()
    how.add_argument("--print-commands", action="store_true",
                     help="print one `harness train` command per run instead of training")
    how.add_argument("--launcher", choices=["local", "slurm"], default="local",
                     help="local: train here, one run after another (default); slurm: print an array job "
                          "(one task per run) to submit with sbatch")
    add_restart_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    check_restart_args(args)
    runs = plan(args.configs, args.overrides, parse_axes(args.grid, args.seeds))
    if args.print_commands:
        print("\n".join(command_lines(runs)), flush=True)
        return 0
    if args.launcher == "slurm":
        print(slurm_array(runs, max_restarts=args.max_restarts, backoff_initial=args.backoff_initial), end="",
              flush=True)
        return 0
    results = sweep(runs, max_restarts=args.max_restarts, crash_loop_limit=args.crash_loop_limit,
                    backoff_initial=args.backoff_initial)
    print(format_summary(results), flush=True)
    return exit_code(results)
