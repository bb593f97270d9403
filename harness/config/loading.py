"""load_config: a TOML file with its `extends`, `unset` and `--set` layers (harness/config_layers.py)
validated as a RunConfig; a mistake is one UserError naming each bad key and where it was set (the
file, the base file for an inherited key, or "command line")."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from pydantic import ValidationError

from harness.config.effects import ignored_keys
from harness.config.run import RunConfig
from harness.config_layers import COMMAND_LINE, Layers, read_layers
from harness.errors import UserError
from optim.config import ARMS, arms_taking


def load_config(path: str | Path, overrides: Iterable[str] = ()) -> RunConfig:
    """Read a TOML file (following `extends` and `unset`), apply `--set` overrides, validate
    (harness/config_layers.py), and refuse a key the config would ignore (effects.py). Each
    section naming user code learns the folder of the file that named it (CodeSection)."""
    layers = read_layers(Path(path), overrides)
    try:
        cfg = RunConfig.model_validate(layers.raw)
    except ValidationError as e:
        raise UserError(_describe(e, layers)) from None
    ignored = ignored_keys(cfg)
    if ignored:
        raise UserError("; ".join(f"{layers.source(key)}: {why}" for key, why in ignored.items()))
    for name in ("task", "model", "data"):
        origin = layers.source(f"{name}.factory")
        getattr(cfg, name).set_code_folder((layers.path if origin == COMMAND_LINE else Path(origin)).resolve().parent)
    return cfg


def _describe(e: ValidationError, layers: Layers) -> str:
    """`SOURCE: key: message` per key, joined with '; ': SOURCE is the file that set the key (an
    inherited key: the base file), or "command line" for a key an override (`--set`, a sweep's
    `--grid`) gave. The members of a union field (`every_steps`: an integer or "auto") fail as
    one key, their messages joined with "or"; an unknown optimizer type is `optim.type`'s."""
    problems: dict[str, list[str]] = {}
    for err in e.errors():
        loc = [x for x in err["loc"] if not (isinstance(x, str) and x in _UNION_TAGS)]
        if len(loc) > 1 and isinstance(loc[-1], str) and not loc[-1].isidentifier():
            loc = loc[:-1]  # pydantic names the union member it tried: constrained-int, literal['auto']
        if err["type"] == "union_tag_invalid":
            loc.append("type")  # the discriminator (optim/config.py: _arm), where the bad value was given
        key = ".".join(str(x) for x in loc)
        template = _MESSAGES.get(err["type"])
        msg = template.format(**err.get("ctx", {}), input=err.get("input")) if template else err["msg"]
        if err["type"] == "extra_forbidden" and len(err["loc"]) == 3 and err["loc"][0] == "optim":
            msg = _optim_key_elsewhere(str(err["loc"][1]), str(err["loc"][2])) or msg
        problems.setdefault(key, []).append(msg)
    parts = []
    for key, messages in problems.items():
        source = layers.source(key)
        parts.append(f"{source}: {key}: {' or '.join(messages)}" if key else f"{source}: {' or '.join(messages)}")
    return "; ".join(parts)


_MESSAGES = {
    "extra_forbidden": "unknown key (check the spelling; see configs/ for the valid keys)",
    "union_tag_invalid": "unknown type {tag!r}; expected one of {expected_tags}",
}


def _optim_key_elsewhere(arm: str, key: str) -> str | None:
    """For an unknown key that another optimizer type has: which types take it (else None)."""
    takers = arms_taking(key)
    if not takers:
        return None
    return (f"unknown key for optim.type = {arm!r}; it belongs to optim.type = "
            f"{' or '.join(repr(t) for t in takers)}: remove it or change optim.type")


# Discriminated-union members appear in pydantic's error locations; users never write them.
_UNION_TAGS = set(ARMS)
