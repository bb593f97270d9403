"""`harness ...`: the command line. Each command lives with the code it drives.

Every command module exposes `register(subparsers)`, which adds its parser and sets
`func(args) -> int` (the exit code). A `UserError` anywhere becomes one line on stderr and exit
code 2, an `Unavailable` (storage outage past its retry deadline) one line and exit code 69;
anything else is a bug and keeps its traceback. The exit code is recorded for launchers that
cannot see it (`exit_codes.record`).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from harness import exit_codes, numerics
from harness.errors import Unavailable, UserError
from harness.log import configure

# Modules that contribute commands, in the order `harness --help` lists them.
COMMAND_MODULES = (
    "harness.train_cli",
    "harness.checkpoint.cli",
    "harness.data.cli",
    "harness.supervisor_cli",
    "harness.report_cli",
    "harness.torture",
    "harness.sweep",
    "harness.compare",
    "harness.verify",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="harness", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    numerics.prepare_environment()  # before a command module imports torch
    parser = build_parser()
    args = parser.parse_args(argv)
    configure(args.log_level)
    code = run_command(args)
    exit_codes.record(code)
    return code


def run_command(args: argparse.Namespace) -> int:
    try:
        return int(args.func(args) or 0)
    except (UserError, Unavailable) as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
