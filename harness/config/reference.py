"""The config reference: every key of a run config with its type, its default, whether a resume
may change it, when it takes effect and what it does, read from the config models themselves
(the sections here and optim/config.py's arms), so it cannot drift from them. `harness config
keys` prints it; docs/config.md is its markdown (`harness config keys --markdown`), which
tests/config/test_reference.py keeps current.

Each key's words are its field's `description`; "free" or "math" is math_keys.py's verdict;
"only ..." is the effects.py rule that names it (set where it would be ignored, the key is
refused at load).
"""

from __future__ import annotations

import textwrap
import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from annotated_types import Ge, Gt, Le, Lt, MinLen
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from harness.config.effects import only_with
from harness.config.math_keys import is_free
from harness.config.run import RunConfig
from harness.config.section import dumped_default
from harness.config.toml_text import value_text
from optim.config import ARMS, ArmConfig

INTRO = """\
Every key a run config (TOML) takes, generated from the config models (harness/config/*.py and,
for [optim], optim/config.py) by `harness config keys --markdown`: do not edit by hand. `harness
config keys [SECTION]` prints the same on a terminal; `harness config show CONFIG` prints a
config resolved (its `extends`, `unset` and `--set` applied, every default filled in).

- **resume**: a *free* key may change between the restarts of a run; a *math* key decides the
  numbers the run computes, and resuming with it changed is refused unless
  `--allow-config-change` (harness/config/math_keys.py).
- **only ...**: the key takes effect only beside another setting; set (to other than its
  default) where it would be ignored, it is refused when the config is read, naming it
  (harness/config/effects.py).
- A key of a table not set takes its default; `unset` means no value (TOML has no null:
  `--set KEY=null`, or `unset = ["KEY"]` in a file that `extends` another, removes a value)."""


@dataclass(frozen=True)
class KeyDoc:
    """One key: dotted (`train.steps`; an entry of a list of tables: `data.sources[].url`), its
    type and default as TOML spells them, "free" or "math", its description and the effects.py
    condition it takes effect under (None: always)."""

    key: str
    type: str
    default: str
    resume: str
    what: str
    only: str | None


@dataclass(frozen=True)
class SectionDoc:
    """A table of the config (`title`: "[train]"; "top level" for the keys outside any table),
    what it is for, and its keys."""

    title: str
    summary: str
    keys: list[KeyDoc]


def sections() -> list[SectionDoc]:
    """The reference: the top-level keys, then each section in RunConfig's order ([optim]: the
    keys every optim.type takes, then one table per type for the keys only it takes)."""
    plain = {n: f for n, f in RunConfig.model_fields.items() if not _section_class(f.annotation)}
    out = [SectionDoc("top level", "Keys outside any table.", list(_keys(plain, "")))]
    for name, field in RunConfig.model_fields.items():
        if name == "optim":
            out.extend(_optim_sections())
        elif name not in plain:
            out.extend(_section_docs(name, _section_class(field.annotation)))
    return out


def _section_docs(dotted: str, cls: type[BaseModel], summary: str | None = None) -> list[SectionDoc]:
    """[dotted] and the sections inside it ([checkpoint.local], summed up by its field's
    description: what the table is for where it is set)."""
    inner = {n: f for n, f in cls.model_fields.items() if _section_class(f.annotation) and not _is_list(f.annotation)}
    own = {n: f for n, f in cls.model_fields.items() if n not in inner}
    out = [SectionDoc(f"[{dotted}]", summary or _summary(cls), list(_keys(own, f"{dotted}.")))]
    for name, field in inner.items():
        out.extend(_section_docs(f"{dotted}.{name}", _section_class(field.annotation), field.description))
    return out


def _optim_sections() -> list[SectionDoc]:
    common = {"type": ARMS["adamw"].model_fields["type"], **ArmConfig.model_fields}
    out = [SectionDoc("[optim]", "The optimizer bundle (optim/config.py); `type` selects the arm, and these keys "
                      "every type takes.", list(_keys(common, "optim.", arm_type=True)))]
    for arm, cls in ARMS.items():
        extra = {n: f for n, f in cls.model_fields.items() if n not in common}
        if extra:
            out.append(SectionDoc(f'[optim] type = "{arm}"', _summary(cls), list(_keys(extra, "optim."))))
    return out


def _keys(fields: dict[str, FieldInfo], prefix: str, arm_type: bool = False) -> Iterator[KeyDoc]:
    for name, field in fields.items():
        key = f"{prefix}{name}"
        rules = only_with(key)
        kind = '"' + '" | "'.join(ARMS) + '"' if arm_type and name == "type" else _type_text(field.annotation,
                                                                                              field.metadata)
        default = '"adamw"' if arm_type and name == "type" else _default_text(field)
        yield KeyDoc(key, kind, default, "free" if is_free(key.split("[")[0]) else "math",
                     field.description or "", "; and only ".join(r.only for r in rules) or None)
        if _is_list(field.annotation) and (entry := _section_class(field.annotation)):
            yield from _keys(entry.model_fields, f"{key}[].")


def _summary(cls: type) -> str:
    return " ".join((cls.__doc__ or "").split("\n\n")[0].split())


def _section_class(annotation: Any) -> Any:
    """The model class `annotation` holds (itself, optional, or as a list's items; of a union of
    classes, [optim]'s, the first), else None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return next((c for c in map(_section_class, get_args(annotation)) if c is not None), None)


def _is_list(annotation: Any) -> bool:
    return get_origin(annotation) is list


def _default_text(field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    return value_text(dumped_default(field))


_SCALARS = {int: "integer", float: "number", str: "string", bool: "boolean", Any: "any"}


def _type_text(annotation: Any, metadata: list[Any] | tuple[Any, ...] = ()) -> str:
    """`annotation` as a reader of TOML says it: `integer >= 1 | "auto"`, `string | unset`,
    `list of string`, `table`."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:
        return _type_text(args[0], [*metadata, *args[1:]])
    if origin in (Union, types.UnionType):
        members = [_type_text(a, metadata) for a in args if a is not type(None)]
        return " | ".join(members) + (" | unset" if type(None) in args else "")
    if origin is Literal:
        return " | ".join(value_text(a) for a in args)
    if origin is list:
        item = "tables" if _section_class(args[0]) else _type_text(args[0])
        item = f"({item})" if " | " in item else item
        return f"list of {item}" + _bounds(metadata)
    if origin is tuple:
        return "[" + ", ".join(_type_text(a) for a in args) + "]"
    if origin is dict or _section_class(annotation):
        return "table"
    return _SCALARS.get(annotation, getattr(annotation, "__name__", str(annotation))) + _bounds(metadata)


def _bounds(metadata: list[Any] | tuple[Any, ...]) -> str:
    words = []
    for item in metadata:
        for bound in item.metadata if isinstance(item, FieldInfo) else [item]:
            if isinstance(bound, Gt):
                words.append(f"> {bound.gt}")
            elif isinstance(bound, Ge):
                words.append(f">= {bound.ge}")
            elif isinstance(bound, Lt):
                words.append(f"< {bound.lt}")
            elif isinstance(bound, Le):
                words.append(f"<= {bound.le}")
            elif isinstance(bound, MinLen):
                words.append(f"(at least {bound.min_length})")
    return f" {' and '.join(words)}" if words else ""


def markdown() -> str:
    """The reference as docs/config.md holds it."""
    lines = ["# Config reference", "", INTRO]
    for section in sections():
        lines.extend(["", f"## {section.title}", "", section.summary, "",
                      "| key | type | default | resume | what it does |", "|---|---|---|---|---|"])
        for k in section.keys:
            what = k.what + (f" *Only {k.only}.*" if k.only else "")
            cells = [f"`{k.key}`", k.type, f"`{k.default}`", k.resume, what]
            lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"


def _named(key: str, prefix: str) -> bool:
    return (not prefix or key == prefix or key.startswith((prefix + ".", prefix + "["))
            or ("." in prefix and key.startswith(prefix)))


_RESUME = {"free": "free: a resume may change it", "math": "math: a resume keeps it"}


def text(prefix: str = "", width: int = 100) -> str:
    """The reference for a terminal, only the keys `prefix` names (a section, `checkpoint`; a key,
    `train.steps`; or the start of keys in a section, `train.spike`); "" for every key."""
    lines = []
    for section in sections():
        keys = [k for k in section.keys if _named(k.key, prefix)]
        if not keys:
            continue
        lines.extend([f"{section.title}: {section.summary}", ""])
        for k in keys:
            lines.append(f"  {k.key} = {k.default}    ({k.type}; {_RESUME[k.resume]})")
            what = k.what + (f" Only {k.only}." if k.only else "")
            lines.extend(textwrap.wrap(what, width, initial_indent="      ", subsequent_indent="      "))
        lines.append("")
    return "\n".join(lines)
