"""A run config's raw layers: TOML files joined by `extends`, then command-line assignments; and
which layer set each key, so that an error names the place to fix (harness/config/ validates).

Contract:
- A file may extend another with a top-level `extends = "base.toml"` (a path relative to the
  file); tables merge recursively, the extending file wins.
- A file that extends another may list `unset = ["train.grad_accum", ...]`: dotted keys removed
  from what it inherits before its own keys merge in, as if no file before it had set them (they
  take their defaults; a batch factor left unset is derived again, config.batch_shape). Unsetting
  a table (`model.args`) removes all of it, so the file's own table replaces it instead of merging
  into it. Unsetting a key nothing before it sets (a misspelling), or a key the same file sets to
  a value, is an error.
- `--set key=value` values are parsed as TOML values (`3`, `1e-3`, `true`, `"s3://b/x"`,
  `[1, 2]`); anything that does not parse as TOML is taken as a bare string, except the bare word
  `null` (TOML has none): `--set key=null` unsets `key` as `unset` does in a file. A quoted
  `"null"` is the string.
- `Layers.source(key)`: the file that set a dotted key last, or "command line".
"""

from __future__ import annotations

import tomllib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.errors import UserError

COMMAND_LINE = "command line"
UNSET_WORD = "null"


@dataclass
class Layers:
    """The merged raw config and, per dotted key, the layer that set it (a file or COMMAND_LINE).
    `path` is the config file named on the command line (the source of whole-config errors)."""

    path: Path
    raw: dict[str, Any] = field(default_factory=dict)
    origins: dict[str, str] = field(default_factory=dict)

    def merge(self, top: dict[str, Any], origin: str) -> None:
        """Merge a file's tables over the layers so far; `origin` set every key it gives."""
        _merge(self.raw, top)
        self._claim(flatten(top), origin)

    def assign(self, dotted: str, value: Any, flag: str = "--set") -> None:
        """`dotted` = `value` (a table value replaces the table), set on the command line."""
        _assign(self.raw, dotted, value, flag)
        self._claim(flatten({dotted: value}), COMMAND_LINE)

    def unset(self, dotted: str, asked: str, before: str) -> None:
        """Remove `dotted` as if no layer had set it. When none did, the UserError names the
        request (`asked`) and the layers searched (`before`)."""
        *parents, leaf = dotted.split(".")
        node: Any = self.raw
        for p in parents:
            node = node.get(p) if isinstance(node, dict) else None
        if not isinstance(node, dict) or leaf not in node:
            raise UserError(f"{asked}: {dotted} is not set by {before}, so there is nothing to unset (check the "
                            f"spelling; a key nothing sets has its default already)")
        del node[leaf]
        self._forget_replaced()

    def source(self, key: str) -> str:
        """Who set dotted `key` (or the table holding it); for a table set piecewise, every layer
        that set a key in it, joined with "and"; else the config file."""
        parts = key.split(".") if key else []
        for n in range(len(parts), 0, -1):
            origin = self.origins.get(".".join(parts[:n]))
            if origin is not None:
                return origin
        below = dict.fromkeys(o for k, o in self.origins.items() if key and k.startswith(key + "."))
        return " and ".join(below) if below else str(self.path)

    def _claim(self, keys: Iterable[str], origin: str) -> None:
        self.origins.update(dict.fromkeys(keys, origin))
        self._forget_replaced()

    def _forget_replaced(self) -> None:
        """Keep origins of the keys the merged config still holds (flattened): a value a later
        layer replaced or removed is no longer attributed to the layer that set it."""
        held = flatten(self.raw)
        self.origins = {k: o for k, o in self.origins.items() if k in held}


def read_layers(path: Path, overrides: Iterable[str] = ()) -> Layers:
    """The file at `path` (following `extends`, applying `unset`), then `--set` `overrides`."""
    layers = Layers(path)
    _read_file(layers, path, seen=(), extended_by=None)
    for item in overrides:
        key, value = _parse_assignment(item, "--set", "train.steps=100")
        if _is_unset(item):
            layers.unset(key, f"--set {key}={UNSET_WORD}", f"{path} (with what it extends) or an earlier --set")
        else:
            layers.assign(key, value)
    return layers


def _read_file(layers: Layers, path: Path, seen: tuple[Path, ...], extended_by: str | None) -> None:
    """Read `path` into `layers`, its bases first; `extended_by` is the `extends` line that
    names it (`FILE: extends = "base.toml"`), None for the config file itself."""
    named = f"{extended_by}: {path}" if extended_by else f"config file {path}"
    if path.is_dir():
        raise UserError(f"{named} is a folder; pass the path of a TOML config in it (see configs/)")
    if not path.is_file():
        fix = "fix the path (it is relative to the extending file)" if extended_by else \
            "pass the path of a TOML config (see configs/)"
        raise UserError(f"{named} does not exist; {fix}")
    if path.resolve() in seen:
        raise UserError(f"{path}: `extends` forms a cycle through {', '.join(map(str, seen))}")
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"{path}: not valid TOML: {e}") from None
    base = raw.pop("extends", None)
    unset = raw.pop("unset", None)
    if base is not None and not isinstance(base, str):
        raise UserError(f"{path}: extends = {base!r}: expected the path of another TOML file as a string, "
                        'e.g. extends = "base.toml"')
    if unset is not None:
        _check_unset(path, unset, raw, base)
    if base is not None:
        _read_file(layers, path.parent / base, seen + (path.resolve(),), extended_by=f'{path}: extends = "{base}"')
    for key in unset or ():
        assert base is not None  # _check_unset refused an unset without extends
        layers.unset(key, f"{path}: unset {key!r}", f"{path.parent / base} (with what it extends)")
    layers.merge(raw, str(path))


def _check_unset(path: Path, unset: Any, own: dict[str, Any], base: str | None) -> None:
    if not isinstance(unset, list) or not all(isinstance(k, str) and k for k in unset):
        raise UserError(f"{path}: unset = {unset!r}: expected a list of dotted keys, "
                        "e.g. unset = [\"train.grad_accum\"]")
    if base is None:
        raise UserError(f"{path}: unset removes keys an extended file sets, but {path} extends none; remove "
                        "unset (a key the file does not set has its default already) or add extends = \"base.toml\"")
    for key in unset:
        node: Any = own
        for p in key.split("."):
            node = node.get(p) if isinstance(node, dict) else None
        if node is not None and not isinstance(node, dict):
            raise UserError(f"{path}: unset lists {key} and the file sets it too; remove one of them")


def _is_unset(item: str) -> bool:
    return item.partition("=")[2].strip() == UNSET_WORD


def _merge(into: dict[str, Any], top: dict[str, Any]) -> None:
    for k, v in top.items():
        if isinstance(v, dict) and isinstance(into.get(k), dict):
            _merge(into[k], v)
        else:
            into[k] = v


def apply_assignments(raw: dict[str, Any], items: Iterable[str], flag: str = "--set",
                      example: str = "train.steps=100") -> dict[str, Any]:
    """Apply `dotted.key=value` items to `raw` (values are TOML values, else plain strings);
    returns `raw`. `flag` and `example` name the option in error messages."""
    for item in items:
        key, value = _parse_assignment(item, flag, example)
        _assign(raw, key, value, flag)
    return raw


def toml_string(text: str) -> str:
    """`text` as a TOML basic string, for a `--set KEY=VALUE` item built in code."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _parse_assignment(item: str, flag: str, example: str) -> tuple[str, Any]:
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise UserError(f"{flag} {item!r}: expected key=value, e.g. {flag} {example}")
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        value = text
    return key, value


def _assign(raw: dict[str, Any], dotted: str, value: Any, flag: str) -> None:
    *parents, leaf = dotted.split(".")
    node = raw
    for p in parents:
        child = node.setdefault(p, {})
        if not isinstance(child, dict):
            raise UserError(f"{flag} {dotted}: {p} is not a section")
        node = child
    node[leaf] = value


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config dict as {dotted key: value} (an empty table is a value)."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out
