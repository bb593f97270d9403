"""A training state as files: tensors in safetensors, every other value in `state.json`.

`capture(parts)` turns named state-dict trees into a `Snapshot` without copying a tensor; the
store serializes it (`store.commit`). An async saver can copy `Snapshot.tensors` into its own
buffers and call `snapshot.with_tensors(copies)`; the JSON side is already detached from the
live objects.

File layout (one folder per checkpoint):
* `<part>.safetensors` for each part with tensors, so `model.safetensors` and
  `optim.safetensors`; tensor names are the key paths joined by "/" (`layer.weight`,
  `state/0/exp_avg`), so a model file can be read by any safetensors reader.
* `rank-NNNNN.safetensors` for the per-rank parts (the ones `capture` is told are per rank: the
  trainer registers its RNG streams and data cursor so, harness/run/state.py); here names carry the
  part as their first component (`rng/torch_cpu`). The format knows no part names.
* Sharded parts (FSDP2: `model` and `optim` hold DTensors; the caller names them, as it names
  the per-rank ones) go to no file of their own: their tensors are kept in the snapshot under the
  pseudo file `sharded.SHARDED` by key path (`model/h.0.attn.weight`), each rank writes its shards
  through DCP (checkpoint/dcp.py), and state.json refers to them as `{"$tensor": ["$dcp", name]}`.
* Tied tensors (one tensor at several key paths of a file's parts, e.g. an embedding shared
  with the output head) are stored once, under the first path's name; every path's reference
  in `state.json` names that entry, and loading reads it once and restores the tie (into_live.py).
  Checkpoints written before this stored each path separately; they load the same.
* `state.json`: `{"format_version", "step", "parts": {part: tree}, "meta"}`. A tree is the
  part's state dict with each tensor replaced by `{"$tensor": [file, name]}`. A dict whose keys
  are not all plain strings (torch optimizers key `state` by int) or that has a key starting
  with "$" is written as `{"$items": [[key, value], ...]}`, so int keys come back as ints.
  Tuples come back as lists. Floats round-trip exactly (repr), NaN and +-Infinity included.

No pickle is involved either way: a checkpoint from a stranger can be inspected and refused
without running any of its code.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from harness.checkpoint.errors import CheckpointError
from harness.checkpoint.later import Later, json_value
from harness.checkpoint.manifest import STATE_FILE
from harness.checkpoint.shard_files import SHARDED, local_nbytes
from harness.checkpoint.tensorfile import serialize
from optim.dtensor import is_dtensor

FORMAT_VERSION = 1
TENSOR_KEY = "$tensor"
ITEMS_KEY = "$items"
_PART_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]*")

WORLD_SIZE_KEY = "world_size"
"""The meta key of the number of ranks that wrote a checkpoint (absent: one process)."""

KeyPath = tuple[str | int, ...]
"""Where a value sits in a part's state dict: the keys and list indices from its root."""


def rank_file(rank: int) -> str:
    """The tensor file of rank `rank`'s per-rank parts."""
    return f"rank-{rank:05d}.safetensors"


def rank_state_file(rank: int) -> str:
    """The JSON side of rank `rank`'s per-rank parts (rank > 0 of a group; in the layout of state.json)."""
    return f"rank-{rank:05d}.json"


def tensor_file(part: str, rank: int, per_rank: Collection[str]) -> str:
    return rank_file(rank) if part in per_rank else f"{part}.safetensors"


def path_str(part: str, path: KeyPath) -> str:
    """How a tensor is named in messages and in `skip`: `part/key/key`."""
    return "/".join([part, *map(str, path)])


@dataclass(frozen=True)
class Snapshot:
    """Everything one rank writes for a checkpoint, in memory.

    `tensors`: file name -> tensor name -> tensor (references to live storage, not copies).
    `parts`: part name -> JSON tree with tensor references (see the module docstring).
    `per_rank`: the names of the parts each rank writes for itself (in `rank_file(rank)`).
    `tensors[SHARDED]`: the sharded parts' tensors (DTensors under FSDP), which every rank writes
    its shards of (checkpoint/dcp.py).
    """

    tensors: Mapping[str, Mapping[str, torch.Tensor]]
    parts: Mapping[str, Any]
    rank: int = 0
    nbytes: int = field(default=0, compare=False)
    per_rank: frozenset[str] = frozenset()

    def own(self) -> Snapshot:
        """What a rank > 0 writes of this snapshot: its per-rank parts and their tensor file."""
        own = rank_file(self.rank)
        tensors = {f: t for f, t in self.tensors.items() if f in (own, SHARDED)}
        return replace(self, tensors=tensors, parts={p: t for p, t in self.parts.items() if p in self.per_rank},
                       nbytes=sum(local_nbytes(t) for named in tensors.values() for t in named.values()))

    def with_tensors(self, tensors: Mapping[str, Mapping[str, torch.Tensor]]) -> Snapshot:
        """The same snapshot over other tensors (e.g. CPU copies); names, shapes, dtypes must match."""
        for file, named in self.tensors.items():
            other = tensors.get(file, {})
            if set(other) != set(named) or any(
                o.shape != t.shape or o.dtype != t.dtype for o, t in ((other[n], named[n]) for n in named)
            ):
                raise ValueError(f"replacement tensors for {file} differ in names, shapes or dtypes")
        if set(tensors) != set(self.tensors):
            raise ValueError(f"replacement tensors cover files {sorted(tensors)}, expected {sorted(self.tensors)}")
        return replace(self, tensors=dict(tensors))  # each file's mapping as given (ChunkedTensors stays one)


def capture(parts: Mapping[str, Any], rank: int = 0, per_rank: Collection[str] = (),
            sharded: Collection[str] = ()) -> Snapshot:
    """Snapshot `parts` (name -> state-dict tree, or an object with `state_dict()`) as rank
    `rank`'s; the parts named in `per_rank` go to `rank_file(rank)`, those in `sharded` to
    `SHARDED` (written through DCP), each other to its own file.

    Tensors are referenced, not copied: the caller must not step the model until the snapshot
    has been committed or copied. Raises `CheckpointError` for a bad part name or a value a
    checkpoint cannot hold without pickle.
    """
    tensors: dict[str, dict[str, torch.Tensor]] = {}
    trees: dict[str, Any] = {}
    for part, value in parts.items():
        if not _PART_NAME.fullmatch(part):
            raise CheckpointError(f"part name {part!r} is not allowed: use letters, digits and '_', "
                                  "starting with a letter")
        file = SHARDED if part in sharded else tensor_file(part, rank, per_rank)
        prefix: KeyPath = (part,) if part in per_rank or part in sharded else ()
        state = value.state_dict() if hasattr(value, "state_dict") else value
        trees[part] = _encode(state, part, (), _Sink(tensors.setdefault(file, {}), file, prefix))
    tensors = {f: named for f, named in tensors.items() if named}
    nbytes = sum(local_nbytes(t) for named in tensors.values() for t in named.values())
    return Snapshot(tensors=tensors, parts=trees, rank=rank, nbytes=nbytes, per_rank=frozenset(per_rank))


@dataclass
class _Sink:
    named: dict[str, torch.Tensor]
    file: str
    prefix: KeyPath
    stored: dict[tuple[Any, ...], str] = field(default_factory=dict)  # view identity -> its name (tied tensors)

    def add(self, path: KeyPath, t: torch.Tensor) -> dict[str, list[str]]:
        view = tensor_view(t)
        if view in self.stored:
            return {TENSOR_KEY: [self.file, self.stored[view]]}
        base = "/".join(map(str, self.prefix + path)) or "_"
        name, n = base, 1
        while name in self.named:  # a key containing "/" can collide with a nested path
            name, n = f"{base}~{n}", n + 1
        self.named[name] = t
        self.stored[view] = name
        return {TENSOR_KEY: [self.file, name]}


def tensor_view(t: torch.Tensor) -> tuple[Any, ...]:
    """What makes two tensor objects the same tensor: storage, offset, shape, strides, dtype,
    device. Empty tensors are never the same (they have no storage to share)."""
    if t.numel() == 0:
        return (id(t),)
    if is_dtensor(t):  # the same tensor as its local shard is (a tied parameter under FSDP)
        return ("dtensor", *tensor_view(t.to_local()))
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t.device)


def _encode(value: Any, part: str, path: KeyPath, sink: _Sink) -> Any:
    if isinstance(value, torch.Tensor):
        return sink.add(path, value)
    if isinstance(value, Mapping):
        if all(isinstance(k, str) and not k.startswith("$") for k in value):
            return {k: _encode(v, part, path + (k,), sink) for k, v in value.items()}
        for k in value:
            if isinstance(k, bool) or not isinstance(k, (str, int)):
                raise CheckpointError(
                    f"{path_str(part, path)} has a key {k!r} of type {type(k).__name__}; "
                    f"state dict keys must be str or int"
                )
        return {ITEMS_KEY: [[k, _encode(v, part, path + (k,), sink)] for k, v in value.items()]}
    if isinstance(value, (list, tuple)):
        return [_encode(v, part, path + (i,), sink) for i, v in enumerate(value)]
    if value is None or isinstance(value, (bool, int, float, str, Later)):
        return value  # a Later is written as its value, after the tensor files (later.py)
    raise CheckpointError(
        f"{path_str(part, path)} is a {type(value).__module__}.{type(value).__name__}; a checkpoint holds "
        f"tensors, dicts, lists and JSON scalars only (no pickle): convert it in that part's state_dict()"
    )


def tensor_refs(tree: Any, path: KeyPath = ()) -> dict[KeyPath, tuple[str, str]]:
    """Every tensor reference in a stored tree: key path -> (file, name)."""
    out: dict[KeyPath, tuple[str, str]] = {}
    _walk(tree, path, lambda p, ref: out.__setitem__(p, ref))
    return out


def sharded_parts(parts: Mapping[str, Any]) -> frozenset[str]:
    """The parts of a stored state (state.json's `parts`) whose tensors were written sharded
    (through DCP, by every rank of an FSDP group)."""
    return frozenset(name for name, tree in parts.items() if any(f == SHARDED for f, _ in tensor_refs(tree).values()))


def _walk(node: Any, path: KeyPath, visit: Callable[[KeyPath, tuple[str, str]], None]) -> None:
    for key, child in _children(node, path):
        ref = _as_ref(child, path + (key,))
        if ref is not None:
            visit(path + (key,), ref)
        else:
            _walk(child, path + (key,), visit)


def _children(node: Any, path: KeyPath) -> list[tuple[str | int, Any]]:
    if isinstance(node, list):
        return list(enumerate(node))
    if not isinstance(node, dict):
        return []
    if ITEMS_KEY in node:
        items = node[ITEMS_KEY]
        if len(node) != 1 or not isinstance(items, list) or not all(
            isinstance(i, list) and len(i) == 2 and type(i[0]) in (str, int) for i in items
        ):
            raise CheckpointError(f"state.json: malformed {ITEMS_KEY} at {'/'.join(map(str, path))}")
        return [(k, v) for k, v in items]
    return list(node.items())


def _as_ref(node: Any, path: KeyPath) -> tuple[str, str] | None:
    if not (isinstance(node, dict) and TENSOR_KEY in node):
        return None
    ref = node[TENSOR_KEY]
    if len(node) != 1 or not (isinstance(ref, list) and len(ref) == 2 and all(isinstance(x, str) for x in ref)):
        raise CheckpointError(f"state.json: malformed tensor reference at {'/'.join(map(str, path))}")
    return ref[0], ref[1]


DROP = object()
"""Returned by a `decode` resolver to leave a tensor out of the tree (a skipped tensor)."""


def decode(tree: Any, resolve: Callable[[KeyPath, tuple[str, str]], Any], path: KeyPath = ()) -> Any:
    """Rebuild a state-dict tree, asking `resolve(path, (file, name))` for each tensor."""
    ref = _as_ref(tree, path)
    if ref is not None:
        return resolve(path, ref)
    if isinstance(tree, list):
        return [None if (v := decode(c, resolve, path + (i,))) is DROP else v for i, c in enumerate(tree)]
    if isinstance(tree, dict):
        pairs = ((k, decode(c, resolve, path + (k,))) for k, c in _children(tree, path))
        return {k: v for k, v in pairs if v is not DROP}
    return tree


def dump_state(step: int, snapshot: Snapshot, meta: Mapping[str, Any] | None) -> bytes:
    """`state.json` bytes: deterministic for the same state, step and meta."""
    doc = {"format_version": FORMAT_VERSION, "step": step, "rank": snapshot.rank,
           "parts": dict(snapshot.parts), "meta": dict(meta or {})}
    try:
        return json.dumps(doc, allow_nan=True, default=json_value).encode()  # no indent: the C encoder, 10x faster
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"checkpoint meta for step {step} is not JSON-able: {e}") from e


def snapshot_files(step: int, snapshot: Snapshot, meta: Mapping[str, Any] | None, url: str, *,
                   own: bool = False) -> Iterator[tuple[str, Iterable[memoryview | bytes]]]:
    """The files of `snapshot` committed as `step` in the checkpoint folder `url`, each as (name,
    its bytes in chunks), produced one at a time: every tensor file (sorted by name), then
    `state.json` with `meta`. Not the sharded parts' files, which every rank writes through DCP
    (checkpoint/dcp.py). `own`: only what a rank > 0 of a group writes, its per-rank tensor file
    and `rank_state_file(rank)` (the JSON side of its per-rank parts, no meta)."""
    if own:
        mine = snapshot.own()
        file = rank_file(snapshot.rank)
        if file in mine.tensors:
            yield file, serialize(mine.tensors[file], f"{url}/{file}")
        yield rank_state_file(snapshot.rank), [dump_state(step, mine, None)]
        return
    for file, tensors in sorted(snapshot.tensors.items()):
        if file != SHARDED:
            yield file, serialize(tensors, f"{url}/{file}")
    yield STATE_FILE, [dump_state(step, snapshot, meta)]


def parse_state(data: bytes, where: str) -> dict[str, Any]:
    """Parse and check a `state.json`; raises `CheckpointError` naming `where`."""
    try:
        doc = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"{where}: not valid JSON ({e}); the checkpoint is corrupt") from e
    if not isinstance(doc, dict) or not isinstance(doc.get("parts"), dict) or not isinstance(doc.get("meta", {}), dict):
        raise CheckpointError(f"{where}: missing 'parts' or malformed 'meta'; not a checkpoint state file")
    if doc.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{where}: format version {doc.get('format_version')!r}, this harness reads version {FORMAT_VERSION}; "
            f"load it with the harness version that wrote it"
        )
    return doc
