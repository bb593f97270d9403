"""`harness train CONFIG`: train, auto-resuming from the newest good checkpoint of the run dir.

With `--max-restarts N` the command supervises itself: it runs the same command without that flag
as a child process and restarts it after transient crashes (see harness/process/supervisor.py).
"""

from __future__ import annotations

import argparse
import sys

from harness.checkpoint.errors import USER_FIXABLE_ERRNOS, storage_errno
from harness.cli.args import add_allow_config_change, add_config_args, add_restart_args, check_restart_args, config_of
from harness.config import batch_shape
from harness.errors import UserError
from harness.topology import topology_from_env


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = commands.add_parser("train", help="train a run; resumes automatically", description=__doc__)
    add_config_args(p)
    p.add_argument("--resume", default="auto", metavar="auto|never|CKPT_URL",
                   help="auto: newest good checkpoint of the run dir (default); never: start fresh; "
                   "or a checkpoint URL")
    add_allow_config_change(p)
    p.add_argument("--takeover", action="store_true",
                   help="take the run dir's writer lease from another holder (only when that process is gone)")
    add_restart_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    check_restart_args(args)
    cfg = config_of(args)
    topology = topology_from_env()
    batch_shape(cfg, topology.world_size)  # a world size the global batch cannot split: refused before joining a group
    if args.max_restarts > 0 and topology.world_size > 1:
        raise UserError(f"--max-restarts supervises one process, but this is rank {topology.rank} of "
                        f"{topology.world_size}: let the launcher restart the group (torchrun --max-restarts N)")
    if args.max_restarts > 0:
        from harness.process.supervisor import supervise_self

        return supervise_self(sys.argv[1:], args.max_restarts, args.crash_loop_limit, cfg.run_dir,
                              cfg.checkpoint.storage_options, log_dir=cfg.log_dir,
                              backoff_initial=args.backoff_initial)
    from harness.parallel.distributed import process_group
    from harness.run.session import train

    try:
        with process_group(cfg.train.device):  # under torchrun with WORLD_SIZE > 1; otherwise nothing
            return train(cfg, resume=args.resume, allow_config_change=args.allow_config_change,
                         takeover=args.takeover)
    except OSError as e:
        # What a person fixes (space, quota, permissions, a read-only mount) wherever it struck
        # outside a save (logs, run.json); saves say more (harness.checkpoint.errors.failed_save).
        if storage_errno(e) not in USER_FIXABLE_ERRNOS:
            raise
        raise UserError(f"{e.strerror or e}: {e.filename or e}; free space there or make it writable, or choose "
                        "another --run-dir (and log_dir)") from None

