"""Comparing two checkpoints: which tensors and JSON values differ, and by how much.

Equal means bitwise equal parts: every tensor has the same name, dtype, shape and bytes (so NaN
payloads and -0.0 count), and every non-tensor value in state.json is the same. The step and
the saved meta are reported when they differ but do not make checkpoints unequal: two runs that
reach the same state are equal even if one was resumed. Tensors are read one pair at a time, so
comparing needs memory for the two largest tensors only.

The same comparison serves `harness ckpt diff` and verify-resume (at one world size or across
several): a part either checkpoint stores sharded (FSDP, through DCP) is compared tensor by
tensor whole, assembled from however each side stores it (consolidate.whole_tensors), so an
FSDP checkpoint and a one-process one of the same state are equal whatever world sizes wrote
them; every other tensor is compared file by file, as stored (their layout is the same at any
world size, but for the per-rank files of ranks only one side has).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

import torch

from harness.checkpoint.consolidate import Whole, whole_tensors
from harness.checkpoint.discovery import CheckpointRef
from harness.checkpoint.format import sharded_parts
from harness.checkpoint.store import CheckpointStore
from harness.checkpoint.tensorfile import TensorEntry, read_tensor

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_MAX_JSON_LINES = 50
_Stored = TypeVar("_Stored", TensorEntry, Whole)  # how a compared tensor is described: a file's entry, or whole


@dataclass(frozen=True)
class Difference:
    """One difference: `where` is `file:tensor` or a `parts/...` JSON path; `part` the state part it
    belongs to; `max_abs` the largest absolute element difference of a tensor (None otherwise)."""

    part: str
    where: str
    line: str
    max_abs: float | None = None


@dataclass
class CheckpointDiff:
    lines: list[str] = field(default_factory=list)
    differences: list[Difference] = field(default_factory=list)

    @property
    def equal(self) -> bool:
        return not self.differences


def diff_checkpoints(a: tuple[CheckpointStore, CheckpointRef],
                     b: tuple[CheckpointStore, CheckpointRef]) -> tuple[list[str], bool]:
    """(report lines, equal) for checkpoints `a` and `b`."""
    result = compare_checkpoints(a, b)
    return result.lines, result.equal


def compare_checkpoints(a: tuple[CheckpointStore, CheckpointRef],
                        b: tuple[CheckpointStore, CheckpointRef]) -> CheckpointDiff:
    """Every difference between checkpoints `a` and `b`, with report lines (JSON ones capped);
    the parts either stores sharded compared whole (module docstring)."""
    (store_a, ref_a), (store_b, ref_b) = a, b
    state_a, state_b = store_a.read_state(ref_a), store_b.read_state(ref_b)
    whole = sorted(sharded_parts(state_a["parts"]) | sharded_parts(state_b["parts"]))
    result = CheckpointDiff()
    lines = result.lines
    if state_a["step"] != state_b["step"]:
        lines.append(f"note: steps differ: {state_a['step']} vs {state_b['step']}")
    if _canon(state_a.get("meta")) != _canon(state_b.get("meta")):
        lines.append("note: meta differs (not compared further)")
    differences = list(_json_diff(_strip(state_a["parts"]), _strip(state_b["parts"]), "parts"))
    lines += differences[:_MAX_JSON_LINES]
    if len(differences) > _MAX_JSON_LINES:
        lines.append(f"... and {len(differences) - _MAX_JSON_LINES} more JSON differences")
    result.differences += [Difference(d.split("/", 2)[1], d.split(": ", 1)[0], d) for d in differences]
    with store_a.open_tensor_files(ref_a) as files_a, store_b.open_tensor_files(ref_b) as files_b:
        for file in sorted(set(files_a) | set(files_b)):
            if file not in files_a or file not in files_b:
                (_, entries, _), side = (files_a[file], "A") if file in files_a else (files_b[file], "B")
                if entries and all(_part_of(file, name) in whole for name in entries):
                    continue  # its tensors are compared whole, below
                line = f"{file}: only in {side}"
                lines.append(line)
                result.differences.append(Difference(file.split(".", 1)[0], file, line))
                continue
            (fa, ea, wa), (fb, eb, wb) = files_a[file], files_b[file]
            for name in sorted(n for n in set(ea) | set(eb) if _part_of(file, n) not in whole):
                _add(result, _tensor_diff(_part_of(file, name), f"{file}:{name}", ea.get(name), eb.get(name),
                                          partial(read_tensor, fa, where=wa), partial(read_tensor, fb, where=wb)))
    for part in whole:
        if part not in state_a["parts"] or part not in state_b["parts"]:
            continue  # the JSON comparison named it
        with whole_tensors(store_a, store_a.open(ref_a), part) as (specs_a, read_a), \
                whole_tensors(store_b, store_b.open(ref_b), part) as (specs_b, read_b):
            for name in sorted(set(specs_a) | set(specs_b)):
                _add(result, _tensor_diff(part, f"{part} (whole):{name}", specs_a.get(name), specs_b.get(name),
                                          partial(_whole, read_a, name), partial(_whole, read_b, name)))
    return result


def _add(result: CheckpointDiff, found: Difference | None) -> None:
    if found:
        result.lines.append(found.line)
        result.differences.append(found)


def _part_of(file: str, name: str) -> str:
    """The part a stored tensor belongs to: rank and shard files hold several parts, each tensor
    named `part/...`; every other file is one part."""
    return name.split("/", 1)[0] if file.startswith(("rank-", "shards-")) else file.split(".", 1)[0]


def _whole(read: Callable[[str], torch.Tensor], name: str, _spec: Whole) -> torch.Tensor:
    """The tensor `name` of `whole_tensors`, read whole (`read(name)`)."""
    return read(name)


def _tensor_diff(part: str, label: str, ea: _Stored | None, eb: _Stored | None,
                 read_a: Callable[[_Stored], torch.Tensor],
                 read_b: Callable[[_Stored], torch.Tensor]) -> Difference | None:
    if ea is None or eb is None:
        return Difference(part, label, f"{label}: only in {'A' if eb is None else 'B'}")
    if ea.dtype != eb.dtype or ea.shape != eb.shape:
        return Difference(part, label, f"{label}: A is {_describe(ea)}, B is {_describe(eb)}")
    ta, tb = read_a(ea).reshape(-1), read_b(eb).reshape(-1)
    bits = _BITS[ta.element_size()]
    differ = ta.view(bits) != tb.view(bits)
    count = int(differ.sum())
    if not count:
        return None
    first = int(differ.nonzero()[0, 0])
    index = list(torch.unravel_index(torch.tensor(first), ea.shape)) if ea.shape else []
    wide = torch.float64 if ta.is_floating_point() or ta.dtype == torch.bool else torch.int64
    delta = (ta.to(wide) - tb.to(wide)).abs()
    max_abs = float(delta[~torch.isnan(delta)].max()) if not bool(torch.isnan(delta).all()) else float("nan")
    return Difference(part, label, f"{label}: {count}/{ta.numel()} elements differ, max abs difference {max_abs:.6g}, "
                      f"first at {[int(i) for i in index]}: A={ta[first].item()!r} B={tb[first].item()!r}", max_abs)


def _describe(e: TensorEntry | Whole) -> str:
    return f"{str(e.dtype).removeprefix('torch.')}{list(e.shape)}"


def _strip(node: Any) -> Any:
    """The JSON tree with tensor references replaced by a marker (tensors are compared by value)."""
    if isinstance(node, dict):
        if set(node) == {"$tensor"}:
            return "<tensor>"
        return {k: _strip(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_strip(v) for v in node]
    return node


def _canon(x: Any) -> str:
    return json.dumps(x, sort_keys=True)


def _json_diff(a: Any, b: Any, path: str) -> Iterator[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in list(a) + [k for k in b if k not in a]:
            if k not in b or k not in a:
                yield f"{path}/{k}: only in {'A' if k in a else 'B'}"
            else:
                yield from _json_diff(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            yield from _json_diff(x, y, f"{path}/{i}")
    elif _canon(a) != _canon(b):
        yield f"{path}: A={_canon(a)[:80]} B={_canon(b)[:80]}"
