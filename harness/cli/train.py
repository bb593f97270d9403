"""`harness train CONFIG`: train, auto-resuming from the newest good checkpoint of the run dir.

With `--max-restarts N` the command supervises itself: it runs the same command without that flag
as a child process and restarts it after transient crashes (see harness/supervisor.py).
"""

from __future__ import annotations

import argparse
import sys

from harness.checkpoint.errors import USER_FIXABLE_ERRNOS, storage_errno
from harness.config import load_config
from harness.distributed import process_group, topology_from_env
from harness.errors import UserError


def register(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("train", help="train a run; resumes automatically", description=__doc__)
    add_config_args(p)
    p.add_argument("--resume", default="auto", metavar="auto|never|CKPT_URL",
                   help="auto: newest good checkpoint of the run dir (default); never: start fresh; or a checkpoint URL")
    p.add_argument("--allow-config-change", action="store_true",
                   help="resume even when keys that change the math differ from the checkpoint's config; "
                        "the new values (lr, weight decay, schedule, ...) apply from the first resumed step")
    p.add_argument("--takeover", action="store_true",
                   help="take the run dir's writer lease from another holder (only when that process is gone)")
    add_restart_args(p)
    p.set_defaults(func=run)


def add_restart_args(p: argparse.ArgumentParser) -> None:
    """--max-restarts and --crash-loop-limit: shared by every command that supervises training."""
    p.add_argument("--max-restarts", type=int, default=0, metavar="N",
                   help="supervise: restart after a transient crash up to N times (default 0: no supervisor)")
    p.add_argument("--crash-loop-limit", type=int, default=3, metavar="K",
                   help="with --max-restarts: give up after K crashes in a row without a newer checkpoint")


def add_config_args(p: argparse.ArgumentParser) -> None:
    """CONFIG, --run-dir and --set: shared by every command that takes a run config."""
    p.add_argument("config", metavar="CONFIG", help="TOML run config (see configs/)")
    p.add_argument("--run-dir", metavar="URL", help="override run_dir (a local path or any fsspec URL)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set train.steps=100 (repeatable)")


def load_from_args(args: argparse.Namespace):
    overrides = list(args.overrides)
    if args.run_dir:
        overrides.append(f"run_dir={_toml_string(args.run_dir)}")
    return load_config(args.config, overrides)


def run(args: argparse.Namespace) -> int:
    cfg = load_from_args(args)
    topology = topology_from_env()
    if args.max_restarts > 0 and topology.world_size > 1:
        raise UserError(f"--max-restarts supervises one process, but this is rank {topology.rank} of "
                        f"{topology.world_size}: let the launcher restart the group (torchrun --max-restarts N)")
    if args.max_restarts > 0:
        from harness.supervisor import supervise_self

        return supervise_self(sys.argv[1:], args.max_restarts, args.crash_loop_limit, cfg.run_dir,
                              cfg.checkpoint.storage_options, log_dir=cfg.log_dir)
    from harness.run import train

    try:
        with process_group():  # under torchrun with WORLD_SIZE > 1; otherwise nothing
            return train(cfg, resume=args.resume, allow_config_change=args.allow_config_change,
                         takeover=args.takeover)
    except OSError as e:
        # What a person fixes (space, quota, permissions, a read-only mount) wherever it struck
        # outside a save (logs, run.json); saves say more (harness.checkpoint.errors.failed_save).
        if storage_errno(e) not in USER_FIXABLE_ERRNOS:
            raise
        raise UserError(f"{e.strerror or e}: {e.filename or e}; free space there or make it writable, or choose "
                        "another --run-dir (and log_dir)") from None


def _toml_string(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
