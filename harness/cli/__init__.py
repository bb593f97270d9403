"""`harness ...`: the command line, one module per command.

The code a command drives lives in the library (harness/...), which never imports from here
(tests/test_import_layers.py).

Every command module exposes `register(subparsers)`, which adds its parser and sets
`func(args) -> int` (the exit code); arguments several commands share are declared once, in
`harness.cli.args`. Command modules are imported only after `numerics.prepare_environment()`,
so the reproducibility settings that must precede torch's import hold for every command. A
command line that names its command imports that command's module only: `harness status`,
`harness report` and `harness config` start without torch (a second, not three CPU-seconds of imports).

A `UserError` anywhere becomes one line on stderr and exit code 2, an `Unavailable` (storage
outage past its retry deadline) one line and exit code 69; anything else is a bug and keeps its
traceback. The exit code is recorded for launchers that cannot see it (`exit_codes.record`). A
process that joined a process group ends through `process_end.end`, without the interpreter's
finalization (see there why). Under torchrun a process dies with the agent that started it
(harness/process/parent_death.py); where the environment names a fork server, a process started
as a fresh interpreter (a torchrun worker, the supervisor's child) has that server fork the real
one and stands in for it (harness/forkserver/relay.py); and one that torchrun restarted after an
attempt that stopped (exit 2 or 3) exits with that code at once (`exit_codes.earlier_stop`).
`--log-level` is accepted before the command and after it (`harness train C --log-level debug`);
on a rank other than 0 the error line starts with its rank (`rank 1: error: ...`, harness/log.py).

This module imports harness.log (structlog: most of its import time) where it is used, after the
relay: a relay, which every torchrun worker and supervisor child of a test session is, needs none
of it and costs a bare interpreter's start and this module's other imports.

Output piped into a reader that stops early (`harness report RUN | head -2`) ends the command
quietly with exit code 141 (128 + SIGPIPE, what a shell reports for a program killed by it),
for every command, instead of a BrokenPipeError traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from harness import exit_codes
from harness.errors import Unavailable, UserError
from harness.forkserver import relay
from harness.process import parent_death, process_end
from harness.repro import numerics
from harness.topology import topology_from_env

# Modules that contribute commands, in the order `harness --help` lists them.
COMMAND_MODULES = (
    "harness.cli.train",
    "harness.cli.ckpt",
    "harness.cli.data",
    "harness.cli.config",
    "harness.cli.supervise",
    "harness.cli.report",
    "harness.cli.status",
    "harness.cli.torture",
    "harness.cli.sweep",
    "harness.cli.compare",
    "harness.cli.verify_resume",
)

LOG_LEVELS = ["debug", "info", "warning", "error"]
BROKEN_PIPE_EXIT_CODE = 141


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser for `argv`: every command's, or only the one `argv` names (its module alone is
    imported); without `argv`, or when it names no known command (help, a typo), all of them."""
    parser = argparse.ArgumentParser(prog="harness", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default="info", choices=LOG_LEVELS)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    named = _command_module(argv) if argv is not None else None
    for name in [named] if named else COMMAND_MODULES:
        importlib.import_module(name).register(commands)
    _accept_log_level_after_commands(commands)
    return parser


def _command_module(argv: list[str]) -> str | None:
    """The module of the command `argv` names (its first word that is not an option), or None.
    A module's command is its name with "-" for "_" (harness.cli.verify_resume: verify-resume)."""
    words = iter(argv)
    for word in words:
        if word == "--log-level":
            next(words, None)
        elif not word.startswith("-"):
            by_command = {m.rsplit(".", 1)[1].replace("_", "-"): m for m in COMMAND_MODULES}
            return by_command.get(word)
    return None


def _accept_log_level_after_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Every (sub)command parser takes `--log-level` too. SUPPRESS as its default: a subcommand
    that was not given the flag must not overwrite the value given before the command."""
    for sub in commands.choices.values():
        sub.add_argument("--log-level", default=argparse.SUPPRESS, choices=LOG_LEVELS,
                         help="console log level (also accepted before the command); ranks other than 0 of "
                         "a launch print their info lines only at debug (rank 0 prints them for all)")
        for action in sub._actions:
            if isinstance(action, argparse._SubParsersAction):
                _accept_log_level_after_commands(action)


def main(argv: list[str] | None = None) -> int:
    parent_death.die_with_launcher()  # first: a worker that outlives torchrun trains on alone
    if argv is None:  # this process's own command line
        code = relay.relayed(sys.argv[1:])
        if code is not None:
            return code
    stopped = exit_codes.earlier_stop()
    if stopped is not None:
        return not_restarted(stopped)
    numerics.prepare_environment()  # before a command module imports torch
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    from harness import log  # here, not above: see the module docstring

    log.configure(args.log_level)
    try:
        code = run_command(args)
    except BaseException as e:
        if not process_end.joined():
            raise
        code = process_end.unhandled(e)  # what the interpreter would print and exit with
    exit_codes.record(code)
    return process_end.end(code)  # after a process group: leaves here, skipping finalization


def not_restarted(code: int) -> int:
    """A torchrun restart after an attempt that stopped (`exit_codes.earlier_stop`): exit with its
    code again, doing nothing; one line per node says why."""
    if topology_from_env().local_rank == 0:
        print(f"harness: not started again: an earlier attempt of this worker group exited {code} "
              f"({exit_codes.NAMES[code]}), which a restart cannot change; torchrun restarts after "
              f"every failure", file=sys.stderr)
    exit_codes.record(code)
    return code


def run_command(args: argparse.Namespace) -> int:
    from harness import log  # here, not above: see the module docstring

    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # a closed pipe shows here, not at interpreter exit
        return code
    except (UserError, Unavailable) as e:
        print(f"{log.rank_prefix()}error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print(f"{log.rank_prefix()}error: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader is gone: point stdout at /dev/null so the interpreter's final flush of the
        # buffered rest does not raise again (the recipe of Python's signal module docs).
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return BROKEN_PIPE_EXIT_CODE
