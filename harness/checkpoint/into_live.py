"""Loading a checkpoint into live parts, streaming, after checking that it fits.

Order of work, so that a checkpoint that does not fit changes nothing:
1. parts: the checkpoint's part names against the targets' (missing / unexpected -> error).
2. plan: every tensor reference in state.json is matched, by key path, with the tensor at the
   same path in the live state (`live_state(target)`: its `state_dict()`, or the cheaper
   `restore_template()` a part may offer) and with its entry in the safetensors header.
   Problems are collected across all parts and raised as one `CheckpointError`:
   * a live tensor with no counterpart in the checkpoint,
   * a checkpoint tensor where the live state has a dict of tensors without that key (a model's
     state dict, an optimizer's per-parameter state),
   * a dtype or shape difference, or a reference to a tensor the file does not have.
3. stream: each file is read once in offset order; a tensor with a live counterpart is read
   straight into the live storage (`copy_` semantics, no second copy), others into new tensors
   (allocated up front, their pages faulted in by a second thread meanwhile: prefault.py). Peak
   extra memory is one tensor, and only when the live one is not a dense CPU tensor.
4. `target.load_state_dict(tree)` for each part in the targets' order; the tree holds the live
   tensors themselves, so a module's or optimizer's own copy is a no-op.

`skip` holds part names (not loaded at all) or tensor paths `part/key/...` (or a prefix of one):
a skipped tensor keeps its live value and is left out of the tree when there is none.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from harness.checkpoint.errors import CheckpointError
from harness.checkpoint.format import DROP, KeyPath, decode, path_str, tensor_refs, tensor_view
from harness.checkpoint.prefault import Prefault
from harness.checkpoint.shard_files import SHARDED
from harness.checkpoint.tensorfile import Opened, Readable, TensorEntry, describe, read_tensor
from optim.dtensor import is_dtensor

# (file handle, header entries, name for messages) of one tensor file of the checkpoint.
OpenTensors = Callable[[ExitStack, str], Opened]
_MAX_LISTED = 30


@dataclass
class _Slot:
    part: str
    path: KeyPath
    file: str
    entry: TensorEntry | None  # None for a sharded tensor (read by DCP)
    live: torch.Tensor | None
    value: torch.Tensor | None = None

    @property
    def stored(self) -> TensorEntry:
        """`entry`, of a slot read from a tensor file (every slot but a sharded tensor's)."""
        assert self.entry is not None, f"{self.file}: a sharded tensor's slot has no entry in a tensor file"
        return self.entry


def _skipped(name: str, skip: Collection[str]) -> bool:
    return any(name == s or name.startswith(s.rstrip("/") + "/") for s in skip)


def live_state(target: Any) -> Any:
    """The live state a checkpoint's part is matched against: `target.restore_template()` when the
    part has one, else `target.state_dict()`. A template holds the same tensors (the live ones) as
    the state dict; a part offers one when its state dict costs more to build than a restore needs
    (the fingerprints part's hashes every other part, and a restore would hash ~the whole state
    only to throw the digests away)."""
    template = getattr(target, "restore_template", None)
    return template() if template is not None else target.state_dict()


def _live_tensors(node: Any, path: KeyPath, out: dict[KeyPath, torch.Tensor], dicts: set[KeyPath]) -> None:
    if isinstance(node, torch.Tensor):
        out[path] = node
    elif isinstance(node, Mapping):
        if node and all(isinstance(v, torch.Tensor) for v in node.values()):
            dicts.add(path)
        for k, v in node.items():
            _live_tensors(v, path + (k,), out, dicts)
    elif isinstance(node, (list, tuple)):
        for i, v in enumerate(node):
            _live_tensors(v, path + (i,), out, dicts)


class ShardedSource(Protocol):
    """The sharded tensors of a checkpoint (state.json references into `sharded.SHARDED`), read
    through DCP into live tensors of any sharding (loading.py builds it)."""

    def check(self, dest: Mapping[str, torch.Tensor]) -> list[str]:
        """Every way the live tensors (name -> tensor) do not fit the stored ones."""

    def load(self, stack: ExitStack, dest: Mapping[str, torch.Tensor]) -> None:
        """Fill the live tensors in place (a collective when there is a process group)."""


def restore_parts(doc: dict[str, Any], targets: Mapping[str, Any], skip: Collection[str], open_tensors: OpenTensors,
                  where: str, check_streamed: Callable[[], None] | None = None,
                  sharded: ShardedSource | None = None) -> None:
    """Load `doc` (a parsed state.json) into `targets`; see the module docstring.
    `check_streamed` runs after step 3 with the files still open, and before a fit problem of
    step 2 is raised; what it raises stops the load before any `load_state_dict`. `sharded`:
    where the tensors of sharded parts come from (step 3 reads them into their live tensors,
    which must exist: a sharded load has no "read into a new tensor")."""
    stored: dict[str, Any] = doc["parts"]
    missing = [p for p in targets if p not in stored and p not in skip]
    unexpected = [p for p in stored if p not in targets and p not in skip]
    if missing or unexpected:
        raise CheckpointError(
            f"{where}: " + "; ".join(
                ([f"has no part(s) {missing} that the live state has"] if missing else [])
                + ([f"has part(s) {unexpected} that the live state does not"] if unexpected else []))
            + ". Load a checkpoint of the same setup, or train this setup in a new run dir (from Python, "
            "harness.checkpoint.load(..., skip=[part names]) keeps the live values of the named parts)"
        )
    parts = [p for p in targets if p not in skip]
    with ExitStack() as stack:
        files: dict[str, Opened] = {}
        slots: dict[str, dict[KeyPath, _Slot]] = {}
        kept: dict[str, dict[KeyPath, torch.Tensor]] = {}
        shard_dest: dict[str, torch.Tensor] = {}
        problems: list[str] = []
        for part in parts:
            slots[part], kept[part] = _plan(part, stored[part], targets[part], skip, files,
                                            lambda f: open_tensors(stack, f), problems, shard_dest)
        if shard_dest:
            problems += sharded.check(shard_dest) if sharded is not None else [
                f"state.json refers to sharded tensors ({next(iter(shard_dest))!r}, ...) but there is no sharded state "
                f"to read them from (corrupt checkpoint)"]
        if problems:
            if check_streamed is not None:
                check_streamed()  # damage first: a damaged header can read as another shape
            more = len(problems) - _MAX_LISTED
            listed = problems[:_MAX_LISTED] + ([f"... and {more} more"] if more > 0 else [])
            raise CheckpointError(
                f"{where} does not fit the live state ({len(problems)} problem(s)); nothing was loaded:\n  "
                + "\n  ".join(listed)
                + "\nFix the model/optimizer setup to match the checkpoint (`harness ckpt show CKPT` prints its config "
                "and tensors), or train this setup in a new run dir (from Python, harness.checkpoint.load(..., "
                "skip=[tensor paths]) keeps the live values of the named tensors)"
            )
        order = _read_order(files, slots)
        firsts: dict[tuple[str, str], _Slot] = {}  # a tied tensor's later paths take its first one's value
        for slot in order:
            firsts.setdefault((slot.file, slot.stored.name), slot)
        new = [s for s in firsts.values() if s.live is None]  # read into new tensors
        prefault = stack.enter_context(Prefault([torch.empty(s.stored.shape, dtype=s.stored.dtype) for s in new]))
        fresh = {id(s): i for i, s in enumerate(new)}
        read: dict[tuple[str, str], torch.Tensor] = {}  # (file, entry name) -> its value: a tied tensor is read once
        for slot in order:
            key = (slot.file, slot.stored.name)
            if key in read:
                slot.value = _tie(slot.live, read[key])
            else:
                into = slot.live if slot.live is not None else prefault.take(fresh[id(slot)])
                slot.value = read[key] = _read_into(files[slot.file][0], slot.stored, files[slot.file][2], into)
        if shard_dest:
            assert sharded is not None  # else the problems above named the sharded tensors, and were raised
            sharded.load(stack, shard_dest)
        if check_streamed is not None:
            check_streamed()
    for part in parts:
        _load_part(part, stored[part], targets[part], slots[part], kept[part], where)


def _read_order(files: Mapping[str, Opened], slots: Mapping[str, Mapping[KeyPath, _Slot]]) -> list[_Slot]:
    """The slots read from tensor files: file by file, in the order they were opened, each file's
    in offset order (one forward pass over it)."""
    return [slot for file in files
            for slot in sorted((s for ps in slots.values() for s in ps.values() if s.file == file),
                               key=lambda s: s.stored.start)]


def _read_into(f: Readable, entry: TensorEntry, where: str, live: torch.Tensor | None) -> torch.Tensor:
    """Read one stored tensor into `live` (or a new tensor). A sharded live tensor (FSDP) loading
    an unsharded checkpoint (DDP, one process) takes its own shard of the whole tensor read."""
    if not is_dtensor(live):
        return read_tensor(f, entry, where, out=live)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset  # loaded: `live` is a DTensor

    whole = read_tensor(f, entry, where)
    shape, offset = compute_local_shape_and_global_offset(whole.shape, live.device_mesh, live.placements)
    for dim, (start, length) in enumerate(zip(offset, shape, strict=True)):
        whole = whole.narrow(dim, start, length)
    with torch.no_grad():
        live.to_local().copy_(whole)
    return live


def _tie(live: torch.Tensor | None, value: torch.Tensor) -> torch.Tensor:
    """A second key path of a tensor stored once: the live tensor when it already shares the
    storage (a tied model), else a copy of the bytes read for the first path."""
    if live is None:
        return value
    if tensor_view(live) != tensor_view(value):
        with torch.no_grad():
            live.copy_(value)
    return live


def _plan(part: str, tree: Any, target: Any, skip: Collection[str], files: dict[str, Opened],
          open_file: Callable[[str], Opened], problems: list[str],
          shard_dest: dict[str, torch.Tensor]) -> tuple[dict[KeyPath, _Slot], dict[KeyPath, torch.Tensor]]:
    live: dict[KeyPath, torch.Tensor] = {}
    tensor_dicts: set[KeyPath] = set()
    _live_tensors(live_state(target), (), live, tensor_dicts)
    refs = tensor_refs(tree)
    slots: dict[KeyPath, _Slot] = {}
    kept: dict[KeyPath, torch.Tensor] = {}
    for path, live_t in live.items():
        if _skipped(path_str(part, path), skip):
            kept[path] = live_t
        elif path not in refs:
            problems.append(f"{path_str(part, path)}: missing from the checkpoint (live {describe(live_t)})")
    for path, (file, name) in refs.items():
        label = path_str(part, path)
        if _skipped(label, skip):
            continue
        if path not in live and path[:-1] in tensor_dicts:
            problems.append(f"{label}: in the checkpoint but not in the live state")
            continue
        if file == SHARDED:  # read through DCP, straight into the live tensor (any sharding)
            t = live.get(path)
            if t is None:
                problems.append(f"{label}: sharded in the checkpoint, and the live state has no tensor to load it into")
            else:
                shard_dest.setdefault(name, t)
                slots[path] = _Slot(part, path, file, None, t, t)
            continue
        if file not in files:
            files[file] = open_file(file)
        entry = files[file][1].get(name)
        if entry is None:
            problems.append(f"{label}: state.json refers to tensor {name!r}, which {file} does not have "
                            "(corrupt checkpoint)")
            continue
        t = live.get(path)
        if t is not None and (t.dtype != entry.dtype or tuple(t.shape) != entry.shape):
            problems.append(f"{label}: checkpoint {entry.describe()}, live {describe(t)}")
            continue
        slots[path] = _Slot(part, path, file, entry, t)
    return slots, kept


def _load_part(part: str, tree: Any, target: Any, slots: dict[KeyPath, _Slot], kept: dict[KeyPath, torch.Tensor],
               where: str) -> None:
    def resolve(path: KeyPath, _ref: tuple[str, str]) -> Any:
        if path in slots:
            return slots[path].value
        return kept.get(path, DROP)

    state = decode(tree, resolve)
    for path, t in kept.items():  # a skipped live tensor the checkpoint lacks keeps its live value
        parent = state
        for key in path[:-1]:
            parent = parent.get(key) if isinstance(parent, dict) else None
        if isinstance(parent, dict):
            parent.setdefault(path[-1], t)
    try:
        target.load_state_dict(state)
    except (RuntimeError, KeyError, ValueError, TypeError, IndexError) as e:
        raise CheckpointError(f"{where}: part {part!r} refused the checkpoint's state: {e}") from e
