"""`harness ckpt consolidate CKPT --out DIR`: a checkpoint's model as one plain safetensors file.

For evaluation and inference: `DIR/model.safetensors` holds every tensor of the `model` part
under its state-dict name (`blocks.0.attn.qkv.weight`), whole, whatever the world size and
sharding the checkpoint was written with, readable by the safetensors library and
`model.load_state_dict`. The checkpoint is verified first (every file against the manifest).

Streaming: the header is written from the shapes alone, then one full tensor at a time is
assembled from its stored chunks (a sharded checkpoint: the DCP metadata says which chunk lies
where, checkpoint/dcp.py) and written; peak memory is the largest tensor, never the model.
An unsharded checkpoint's tensors are read one at a time from its `model.safetensors` likewise.
`whole_tensors` is that reading for any part (verify-resume compares the optimizer state whole too);
`harness ckpt export --format hf` (harness/export/hf_folder.py) writes the model's tensors through it as well.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from harness.checkpoint.discovery import CheckpointRef
from harness.checkpoint.errors import CheckpointCorrupt, CheckpointError
from harness.checkpoint.format import tensor_refs
from harness.checkpoint.loading import Checkpoint, open_tensors, read_listed
from harness.checkpoint.shard_files import MAX_METADATA_BYTES, METADATA_FILE, SHARDED
from harness.checkpoint.store import CheckpointStore
from harness.checkpoint.tensorfile import Opened, Readable, TensorEntry, read_tensor, stream
from harness.storage.location import output_folder, write_stream

if TYPE_CHECKING:  # DCP: imported only for a sharded checkpoint (`_sharded`)
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from harness.checkpoint.dcp import ShardLocation

MODEL_PART = "model"
MODEL_FILE = "model.safetensors"


def consolidate(store: CheckpointStore, ref: CheckpointRef, out: str,
                storage_options: dict[str, Any] | None = None) -> tuple[str, int]:
    """Write `ref`'s model part to `out/model.safetensors` (a local folder or URL); returns (its
    URL, bytes). Raises `CheckpointCorrupt` for a damaged checkpoint, `CheckpointError` for one
    without a model part or an `out` that is a file or cannot be written to."""
    with whole_tensors(store, open_verified(store, ref), MODEL_PART) as (specs, produce):
        dest = output_folder(out, storage_options, "--out")
        path = f"{dest.root}/{MODEL_FILE}"
        size, _ = write_stream(dest, path, stream(specs, produce))
    return dest.url_of(path), size


def open_verified(store: CheckpointStore, ref: CheckpointRef) -> Checkpoint:
    """`ref` opened (`store.open`) after every file was checked against its manifest; a damaged
    checkpoint is a `CheckpointCorrupt` before anything is written from it."""
    problems = store.verify(ref)
    if problems:
        raise CheckpointCorrupt(f"{ref.url} fails verification, nothing written: {problems[0]}")
    return store.open(ref)


class Whole(NamedTuple):
    """A tensor's dtype and full (unsharded) shape."""

    dtype: torch.dtype
    shape: tuple[int, ...]


Refs = dict[str, tuple[str, str]]  # a tensor's name (key path joined by "/") -> (file, name there) of state.json
OpenFile = Callable[[str], Opened]
Wholes = tuple[dict[str, Whole], Callable[[str], torch.Tensor]]  # what `whole_tensors` yields

@contextmanager
def whole_tensors(store: CheckpointStore, checkpoint: Checkpoint,
                  part: str) -> Iterator[Wholes]:
    """Every tensor of `part` in `checkpoint` (opened: `store.open`), whole, whatever the world
    size and sharding it was written with: (name -> Whole, produce(name) -> the full tensor, one
    per call, assembled from its stored chunks). Names are the key paths joined by "/" (a
    model's state-dict names). The files are open while the context lasts; nothing is verified
    here. Raises `CheckpointError` when the checkpoint has no such part, `CheckpointCorrupt` when
    a reference or chunk is missing."""
    ref = checkpoint.ref
    tree = checkpoint.state["parts"].get(part)
    if tree is None:
        raise CheckpointError(f"{ref.url} has no {part!r} part")
    refs = {"/".join(map(str, path)): where for path, where in tensor_refs(tree).items()}
    records = checkpoint.records
    with ExitStack() as stack:
        opened: dict[str, Opened] = {}

        def file(name: str) -> Opened:
            if name not in records:
                raise CheckpointCorrupt(f"{ref.url}: state.json refers to {name!r}, which the manifest does not list")
            if name not in opened:
                opened[name] = open_tensors(store.loc, stack, ref, records[name])
            return opened[name]

        if any(f == SHARDED for f, _ in refs.values()):
            yield _sharded(store, checkpoint, refs, file)
        else:
            yield _unsharded(refs, file)


def _unsharded(refs: Refs, file: OpenFile) -> Wholes:
    def entry(name: str) -> tuple[Readable, TensorEntry, str]:
        f, entries, where = file(refs[name][0])
        if refs[name][1] not in entries:
            raise CheckpointCorrupt(f"{where}: has no tensor {refs[name][1]!r}")
        return f, entries[refs[name][1]], where

    specs = {name: Whole(entry(name)[1].dtype, entry(name)[1].shape) for name in refs}
    return specs, lambda name: read_tensor(*entry(name))


def _sharded(store: CheckpointStore, checkpoint: Checkpoint, refs: Refs, file: OpenFile) -> Wholes:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from harness.checkpoint.dcp import metadata_from_json  # DCP: only sharded checkpoints load it

    meta_bytes = read_listed(store.loc, checkpoint.ref, checkpoint.manifest, METADATA_FILE, MAX_METADATA_BYTES)
    metadata = metadata_from_json(meta_bytes, f"{checkpoint.ref.url}/{METADATA_FILE}")
    chunks: dict[str, list[tuple[tuple[int, ...], ShardLocation]]] = {}
    for index, location in metadata.storage_data.items():
        chunks.setdefault(index.fqn, []).append((tuple(index.offset), location))

    def stored(name: str) -> tuple[str, TensorStorageMetadata]:
        fqn = refs[name][1]
        meta = metadata.state_dict_metadata.get(fqn)
        if meta is None:
            raise CheckpointCorrupt(f"{checkpoint.ref.url}: the DCP metadata has no tensor {fqn!r}")
        assert isinstance(meta, TensorStorageMetadata)  # metadata_from_json lists tensors only
        return fqn, meta

    def produce(name: str) -> torch.Tensor:
        fqn, meta = stored(name)
        full = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        covered = 0
        for offsets, location in sorted(chunks.get(fqn, [])):
            f, entries, where = file(location.file)
            entry = entries.get(location.tensor)
            if entry is None:
                raise CheckpointCorrupt(f"{where}: has no tensor {location.tensor!r}")
            view = full
            for dim, (start, length) in enumerate(zip(offsets, entry.shape, strict=False)):
                view = view.narrow(dim, start, length)
            read_tensor(f, entry, where, out=view)  # straight into the full tensor (a copy when not contiguous)
            covered += view.numel()
        if covered != full.numel():
            raise CheckpointCorrupt(f"{checkpoint.ref.url}: the stored chunks of {fqn!r} hold {covered} of its "
                                    f"{full.numel()} elements")
        return full

    specs = {}
    for name in refs:
        _, meta = stored(name)
        specs[name] = Whole(meta.properties.dtype, tuple(meta.size))
    return specs, produce
