"""Sweep grids: `--grid KEY=V1,V2,... --seeds 0,1,2` -> the named runs of `harness sweep`.

Contract:
- An axis is one config key (any dotted key `--set` takes) and its values, written
  `KEY=V1,V2,...`; each value is a TOML scalar as in `--set` (`1e-3`, `true`, `"cosine"`).
  `--seeds S1,S2,...` is the axis `train.seed` (integers). Several axes multiply.
- A grid point's run name is made of the varied values only, `LABEL=VALUE` joined by `_`, in the
  order the axes were given with the seed last (`lr=3e-3_seed=1`); LABEL is the key's last part
  (the full key when two axes share it), VALUE the text as written (quotes dropped; characters
  other than letters, digits and `.+-` become `-`). Names are unique or the grid is refused.
- Points are listed seed-major: every point of the first seed, then of the next, the last --grid
  varying fastest, so a sweep stopped half-way has whole lr curves of its first seeds.
- Bad syntax (no `=`, an empty key or value, a repeated key or value, a seed that is not an
  integer, a grid over run_dir/log_dir) is a UserError naming it; unknown keys are found when the
  sweep loads every point's config, before anything starts.
"""

from __future__ import annotations

import itertools
import re
import tomllib
from dataclasses import dataclass
from typing import Any

from harness.errors import UserError

SEED_KEY = "train.seed"
# Each grid point gets its own run dir under the sweep's; a grid over these would undo that.
RESERVED_KEYS = ("run_dir", "log_dir")
_NAME_UNSAFE = re.compile(r"[^A-Za-z0-9.+-]")


@dataclass(frozen=True)
class Axis:
    key: str
    texts: tuple[str, ...]  # the values as written (run names, --set items)


@dataclass(frozen=True)
class GridPoint:
    name: str  # "" for the empty grid: the config's own run dir
    assignments: tuple[str, ...]  # KEY=VALUE items, as `--set` takes them


def parse_axes(grids: list[str], seeds: str | None) -> list[Axis]:
    """The axes of `--grid` items and `--seeds`; UserError on bad syntax."""
    axes = [_parse_grid(item) for item in grids]
    if seeds is not None:
        texts = _split(seeds, "--seeds", "--seeds 0,1,2")
        for text in texts:
            if not re.fullmatch(r"-?\d+", text):
                raise UserError(f"--seeds {seeds}: {text!r} is not an integer; e.g. --seeds 0,1,2")
        axes.append(Axis(SEED_KEY, tuple(texts)))
    keys = [a.key for a in axes]
    for key in keys:
        if keys.count(key) > 1:
            hint = " (--seeds is the train.seed axis)" if key == SEED_KEY else ""
            raise UserError(f"--grid {key} is given twice{hint}; list all its values in one --grid {key}=V1,V2")
    return axes


def _parse_grid(item: str) -> Axis:
    example = "--grid optim.lr=1e-3,3e-3,1e-2"
    key, sep, values = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise UserError(f"--grid {item!r}: expected KEY=V1,V2,..., e.g. {example}")
    if key in RESERVED_KEYS:
        raise UserError(f"--grid {key}: every grid point gets its own {key} under the sweep's; "
                        f"set the sweep's with --set {key}=... instead")
    texts = _split(values, f"--grid {key}", example)
    for text in texts:
        _check_scalar(text, key)
    return Axis(key, tuple(texts))


def _split(values: str, flag: str, example: str) -> list[str]:
    texts = [t.strip() for t in values.split(",")]
    if any(not t for t in texts):
        raise UserError(f"{flag}={values}: an empty value; separate values by single commas, e.g. {example}")
    for t in texts:
        if texts.count(t) > 1:
            raise UserError(f"{flag}={values}: {t} is listed twice")
    return texts


def _check_scalar(text: str, key: str) -> None:
    """A grid value is one scalar: arrays and tables would be cut apart at their commas."""
    try:
        value: Any = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        value = text  # a bare string, as --set takes it
    if isinstance(value, (list, dict)) or text.startswith(("[", "{")):
        raise UserError(f"--grid {key}={text}: a grid value must be a number, boolean or string; "
                        f"vary a list or table with one --set per run instead")


def expand(axes: list[Axis]) -> list[GridPoint]:
    """Every combination of the axes (seed-major), named; [GridPoint("", ())] for no axes."""
    if not axes:
        return [GridPoint("", ())]
    labels = _labels([a.key for a in axes])
    seed_first = sorted(range(len(axes)), key=lambda i: axes[i].key != SEED_KEY)
    points = []
    for combo in itertools.product(*(axes[i].texts for i in seed_first)):
        chosen = dict(zip(seed_first, combo, strict=True))
        name = "_".join(f"{labels[i]}={_name_part(chosen[i])}" for i in range(len(axes)))
        points.append(GridPoint(name, tuple(f"{axes[i].key}={chosen[i]}" for i in range(len(axes)))))
    names = [p.name for p in points]
    for name in names:
        if names.count(name) > 1:
            raise UserError(f"two grid points are both named {name!r} (values that differ only in characters "
                            f"a run name cannot hold); write the values apart")
    return points


def _name_part(text: str) -> str:
    return _NAME_UNSAFE.sub("-", text.strip("\"'"))


def _labels(keys: list[str]) -> list[str]:
    leaves = [k.rsplit(".", 1)[-1] for k in keys]
    return [leaf if leaves.count(leaf) == 1 else key for key, leaf in zip(keys, leaves, strict=True)]
