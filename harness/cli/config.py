"""`harness config keys|show`: the config's keys, and a config resolved. Neither imports torch.

`keys [PREFIX]` prints every key a run config takes (type, default, whether a resume may change
it, when it takes effect, what it does), or those of a section or key (`checkpoint`,
`train.steps`); `--markdown` prints docs/config.md (harness/config/reference.py).
`show CONFIG [--set KEY=VALUE]...` reads and checks a config as `harness train` does and prints
it resolved (its `extends`, `unset` and `--set` applied) as TOML, every default filled in as a
comment and storage credentials redacted: it reads back as the same config (the credentials
aside).
"""

from __future__ import annotations

import argparse

from harness.cli.args import add_config_args, config_of
from harness.config import public_config
from harness.config.reference import markdown, sections, text
from harness.config.toml_text import document
from harness.errors import UserError


def cmd_keys(args: argparse.Namespace) -> int:
    if args.markdown:
        if args.prefix:
            raise UserError("--markdown prints the whole reference (docs/config.md): leave out the section")
        print(markdown(), end="")
        return 0
    shown = text(args.prefix)
    if not shown:
        tables = ", ".join(dict.fromkeys(k.key.split(".")[0] for s in sections()[1:] for k in s.keys))
        raise UserError(f"no config key is or starts with {args.prefix!r}; the sections are {tables} (`harness "
                        "config keys` lists every key)")
    print(shown, end="")
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    cfg = config_of(args)
    print(document(public_config(cfg), cfg.model_dump(mode="json", exclude_unset=True)), end="")
    return 0


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("config", help="the config's keys; a config resolved", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="config_command", required=True, metavar="SUBCOMMAND")
    p = commands.add_parser("keys", help="every config key: type, default, resume, what it does")
    p.add_argument("prefix", nargs="?", default="", metavar="SECTION",
                   help="only this section's keys, or this key (e.g. checkpoint, train.steps)")
    p.add_argument("--markdown", action="store_true", help="the whole reference as markdown (docs/config.md)")
    p.set_defaults(func=cmd_keys)
    p = commands.add_parser("show", help="a config resolved (extends, unset, --set applied) as TOML, defaults "
                                         "as comments")
    add_config_args(p)
    p.set_defaults(func=cmd_show)
