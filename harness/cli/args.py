"""Arguments that several commands take, declared once: a run config (CONFIG, --run-dir, --set),
--allow-config-change, the self-supervision flags and the `-o KEY=VALUE` storage options.

Each `add_*` adds its arguments to a command's parser; `*_of(args)` reads them back.
"""

from __future__ import annotations

import argparse
from typing import Any

from harness.config import RunConfig, load_config
from harness.config_layers import apply_assignments, toml_string
from harness.errors import UserError


def add_config_args(p: argparse.ArgumentParser, *, run_dir: bool = True) -> None:
    """CONFIG, --run-dir (unless `run_dir` is False) and --set: every command that takes one run config."""
    p.add_argument("config", metavar="CONFIG", help="TOML run config (see configs/)")
    if run_dir:
        p.add_argument("--run-dir", metavar="URL", help="override run_dir (a local path or any fsspec URL); "
                       "wins over run_dir in the config and in --set")
    add_overrides(p)


def add_overrides(p: argparse.ArgumentParser, scope: str = "a config key") -> None:
    """--set KEY=VALUE (repeatable), read back as `args.overrides`; `scope` says what it overrides."""
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help=f"override {scope}, e.g. --set train.steps=100 (a TOML value; repeatable); "
                        "KEY=null unsets a key the config sets, as if it never had")


def add_allow_config_change(p: argparse.ArgumentParser) -> None:
    p.add_argument("--allow-config-change", action="store_true",
                   help="resume even when keys that change the math differ from the checkpoint's config; "
                        "the new values (lr, weight decay, schedule, ...) apply from the first resumed step")


def add_restart_args(p: argparse.ArgumentParser) -> None:
    """--max-restarts, --crash-loop-limit and --backoff-initial: every command that supervises training."""
    p.add_argument("--max-restarts", type=int, default=0, metavar="N",
                   help="supervise: restart after a transient crash up to N times (default 0: no supervisor)")
    p.add_argument("--crash-loop-limit", type=int, default=3, metavar="K",
                   help="with --max-restarts: give up after K crashes in a row without a newer checkpoint")
    p.add_argument("--backoff-initial", type=float, default=1.0, metavar="S",
                   help="with --max-restarts: seconds before the first restart of a crash streak, doubling "
                        "with each crash in a row (default 1)")


def check_restart_args(args: argparse.Namespace) -> None:
    """A one-line error for restart arguments out of range."""
    if args.max_restarts < 0 or args.crash_loop_limit < 1 or args.backoff_initial < 0:
        raise UserError("--max-restarts and --backoff-initial must be >= 0 and --crash-loop-limit >= 1")


def config_of(args: argparse.Namespace) -> RunConfig:
    """The run config named by `add_config_args`' arguments, --run-dir applied last."""
    overrides = list(args.overrides)
    if getattr(args, "run_dir", None):
        overrides.append(f"run_dir={toml_string(args.run_dir)}")
    return load_config(args.config, overrides)


def storage_option_parser() -> argparse.ArgumentParser:
    """A parent parser adding `-o KEY=VALUE` (repeatable); read it back with `storage_options_of`."""
    storage = argparse.ArgumentParser(add_help=False)
    storage.add_argument("-o", "--storage-option", dest="storage_option", action="append", default=[],
                         metavar="KEY=VALUE", help="a storage option, as in checkpoint.storage_options "
                         "(repeatable; dotted keys nest: -o retry.deadline_s=30)")
    return storage


def storage_options_of(args: argparse.Namespace) -> dict[str, Any] | None:
    """The `-o KEY=VALUE` storage options (dotted keys nest: `retry.deadline_s=30`)."""
    return apply_assignments({}, args.storage_option, "-o", "endpoint_url=http://127.0.0.1:9000") or None
