"""`harness torture RUN_DIR_URL`: crash-consistency torture of the checkpoint store (the sweep
itself and what it checks: harness/verify/torture_sweep.py)."""

from __future__ import annotations

import argparse

from harness.checkpoint.errors import CheckpointError
from harness.cli.args import storage_option_parser, storage_options_of
from harness.log import configure
from harness.storage.location import output_folder
from harness.verify.torture_sweep import (
    ALL_MODES,
    DEFAULT_MODES,
    Torture,
    __doc__ as torture_doc,
    corruption_sweep,
    format_table,
)


def run(args: argparse.Namespace) -> int:
    if args.log_level == "info":
        configure("error")  # the sweep provokes thousands of expected warnings
    modes = ALL_MODES if args.modes == "all" else tuple(m.strip() for m in args.modes.split(",") if m.strip())
    unknown = [m for m in modes if m not in ALL_MODES]
    if unknown:
        raise CheckpointError(f"--modes: unknown mode(s) {unknown}; use some of {', '.join(ALL_MODES)} or 'all'")
    points = None if args.points == "all" else int(args.points)
    # Checked before the sweep: a failed write inside it is a point's result, not the user's folder.
    output_folder(args.run_dir, storage_options_of(args), "scratch folder")
    torture = Torture(args.run_dir, storage_options_of(args))
    tallies = torture.sweep(modes, points)
    print(format_table(torture.kind, tallies))
    failures = [p for t in tallies.values() for p in t.failures]
    for p in failures:
        print(f"  {p.result}: {p.mode}@{p.at} ({p.op}): {p.detail}")
    ok = not failures
    if args.corruption:
        c = corruption_sweep(torture)
        print(f"corruption: {c.cases} damaged files, {c.detected} detected, {c.named} named the file, "
              f"{c.fell_back} fell back to the previous checkpoint, {c.cli_failed} failed `harness ckpt verify`")
        for miss in c.misses:
            print(f"  missed: {miss}")
        ok = ok and not c.misses and c.cli_failed == c.cases
    return 0 if ok else 1


def _points(value: str) -> str:
    if value != "all" and not (value.isdigit() and int(value) >= 1):
        raise argparse.ArgumentTypeError("use 'all' or a number of points >= 1")
    return value


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("torture", help="crash-consistency torture of the checkpoint store",
                              description=torture_doc.split("\n\n")[0], parents=[storage_option_parser()])
    p.add_argument("run_dir", metavar="RUN_DIR_URL", help="a scratch folder or URL (points use sub-folders of it)")
    p.add_argument("--points", type=_points, default="all", help="'all' operations of a save, or N evenly spaced ones")
    p.add_argument("--modes", default=",".join(DEFAULT_MODES),
                   help=f"comma-separated, from {', '.join(ALL_MODES)}; or 'all' (default: {','.join(DEFAULT_MODES)})")
    p.add_argument("--corruption", action="store_true", help="also damage a committed checkpoint file by file")
    p.set_defaults(func=run)
