"""Config values as TOML writes them: one value (`value_text`: the reference's defaults, the
errors that quote a value) and a whole resolved config as a TOML document (`document`: `harness
config show`), which load_config reads back as the same config.

TOML has no null, and a config read from TOML holds None only where that is the key's default
(`--set KEY=null` unsets a key): such a key is one of the commented defaults.
"""

from __future__ import annotations

import json
import math
from typing import Any

UNSET = "unset"


def value_text(value: Any) -> str:
    """`value` (JSON-able: what model_dump(mode="json") gives) as a TOML value; None: "unset"."""
    if value is None:
        return UNSET
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a TOML basic string
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(value_text(v) for v in value) + "]"
    if isinstance(value, dict):
        items = ", ".join(f"{_key(k)} = {value_text(v)}" for k, v in value.items() if v is not None)
        return "{" + (f" {items} " if items else "") + "}"
    raise TypeError(f"no TOML form for a {type(value).__name__}")


def document(tree: dict[str, Any], given: dict[str, Any]) -> str:
    """`tree` (a config as model_dump(mode="json") gives it) as a TOML document: its plain keys
    first, then a table per section (a section inside a section: its own [a.b] table). A key
    not in `given` (the same config dumped with exclude_unset: what its files and --set gave) is
    written as a comment, so the document reads back as the same config, a factor the config
    derives (train.global_batch's) still derived."""
    lines = ["# Keys in comments take their defaults (or are derived)."]
    _table(tree, given, [], lines)
    return "\n".join(lines).strip() + "\n"


def _table(tree: dict[str, Any], given: dict[str, Any], path: list[str], lines: list[str]) -> None:
    tables = {k: v for k, v in tree.items() if isinstance(v, dict) and _is_section(path + [k])}
    if path:
        lines.extend(["", f"[{'.'.join(_key(p) for p in path)}]"])
    for key, value in tree.items():
        if key not in tables:
            line = f"{_key(key)} = {value_text(value)}"
            lines.append(line if key in given and value is not None else f"# {line}")
    for key, value in tables.items():
        _table(value, given.get(key) or {}, path + [key], lines)


def _is_section(path: list[str]) -> bool:
    """Whether the table at `path` is a config section (written as a [table]) rather than a
    key's value (an `args` or `storage_options` table, written inline): a section's tables are at
    the top or `checkpoint.local`."""
    return len(path) == 1 or path == ["checkpoint", "local"]


def _key(key: str) -> str:
    bare = key.replace("_", "").replace("-", "").isalnum() and key.isascii()
    return key if bare else json.dumps(key)
