"""Sharded parts (FSDP2 DTensors) written and read through torch.distributed.checkpoint (DCP),
by our own StorageWriter/StorageReader onto the checkpoint store.

The trade-off first: DCP's planners decide which rank writes which shard (a replicated tensor
once, each DTensor shard by its owner) and how a checkpoint written by N ranks is read by M
(any mesh, or plain tensors: DDP / one process); we keep the rest. DCP's own FileSystemWriter
pickles its `.metadata` and carries no content hashes; here
* each rank's shards go into one safetensors file of its own, `shards-NNNNN.safetensors`, named
  `FQN@OFFSETS` (FQN = the part's key path, `model/h.0.attn.weight`; OFFSETS = where the shard
  starts in the full tensor), written and read by tensorfile.py (no pickle, header checked first);
* the DCP `Metadata` is JSON (`dcp-metadata.json`, `metadata_to_json` / `metadata_from_json`),
  written by the coordinator (rank 0); tensors only: a non-tensor value of a sharded part stays
  in state.json, so a `BYTE_IO` item (DCP would `torch.save` it) is refused;
* every file is written through the store (`write_file`: durable, hashed), reported in the
  group commit's outcome and listed in the manifest rank 0 writes last (checkpoint/save/group_commit.py);
* reading opens only files the manifest lists (`open_file`), in offset order, so a verified
  load hashes every byte as it lands in the live tensors (loading.py, `Verify.WHILE`);
* a rank's own checkpoint (the local tier: `save_shards(own=True)`) is the same with that rank
  its own coordinator: its shard file and a metadata file listing its chunks alone, read back by
  the same `load_shards` after `check_fit` found them covering its live shares.

A tensor of a sharded part is referenced in state.json as `{"$tensor": ["$dcp", FQN]}`
(`SHARDED`, not a file name a manifest can hold), so the JSON side of the part stays where every
other part's is and the format knows no part names. Those names live in shard_files.py, which
every checkpoint path imports; this module only sharded saves and loads do (DCP costs time at
process start).
"""

from __future__ import annotations

import json
import math
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import (
    STORAGE_TYPES,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from harness.checkpoint.errors import CheckpointCorrupt, CheckpointError
from harness.checkpoint.shard_files import METADATA_FILE, shard_file
from harness.checkpoint.tensorfile import CODES, DTYPES, Opened, Readable, TensorEntry, read_tensor, serialize
from optim.dtensor import is_dtensor

if TYPE_CHECKING:  # manifest.py imports format.py, which imports this module
    from harness.checkpoint.manifest import FileRecord

METADATA_FORMAT = 1


@dataclass(frozen=True)
class ShardLocation:
    """Where one stored chunk lies: its file and its tensor name there (DCP's `storage_data`)."""

    file: str
    tensor: str


def _chunk_name(fqn: str, offsets: Iterable[int]) -> str:
    return f"{fqn}@{','.join(map(str, offsets))}"


# ---- the metadata as JSON ---------------------------------------------------------------------

def metadata_to_json(md: Metadata) -> bytes:
    """DCP `Metadata` as deterministic JSON (no pickle): the tensors' global sizes, dtypes and
    stored chunks, where each chunk lies, and the planner's flattening map."""
    tensors = {}
    for fqn, meta in sorted(md.state_dict_metadata.items()):
        if not isinstance(meta, TensorStorageMetadata):
            raise CheckpointError(f"sharded state {fqn!r} is not a tensor; only tensors go through DCP here")
        tensors[fqn] = {"dtype": CODES[meta.properties.dtype], "size": list(meta.size),
                        "chunks": [[list(c.offsets), list(c.sizes)] for c in meta.chunks]}
    storage = sorted([idx.fqn, list(idx.offset or ()), loc.file, loc.tensor]
                     for idx, loc in (md.storage_data or {}).items())
    planner = {k: list(v) for k, v in sorted((md.planner_data or {}).items())}
    doc = {"format_version": METADATA_FORMAT, "dcp_version": md.version, "tensors": tensors, "storage": storage,
           "planner_data": planner}
    return json.dumps(doc, separators=(",", ":")).encode()


def metadata_from_json(data: bytes, where: str) -> Metadata:
    """The `Metadata` of `metadata_to_json`; `CheckpointCorrupt` naming `where` on any defect."""
    try:
        doc = json.loads(data.decode("utf-8"))
        if doc["format_version"] != METADATA_FORMAT:
            raise ValueError(f"format version {doc['format_version']!r}, this harness reads {METADATA_FORMAT}")
        state: dict[str, STORAGE_TYPES] = {}
        for fqn, t in doc["tensors"].items():
            chunks = [ChunkStorageMetadata(torch.Size(_ints(o)), torch.Size(_ints(s))) for o, s in t["chunks"]]
            state[fqn] = TensorStorageMetadata(TensorProperties(dtype=DTYPES[t["dtype"]]), torch.Size(_ints(t["size"])),
                                               chunks)
        storage = {}
        for fqn, offset, file, tensor in doc["storage"]:
            if not all(isinstance(x, str) for x in (fqn, file, tensor)):
                raise ValueError("a storage entry's fqn, file and tensor must be strings")
            storage[MetadataIndex(fqn, torch.Size(_ints(offset)))] = ShardLocation(file, tensor)
        planner = {k: tuple(v) for k, v in doc["planner_data"].items()}
        return Metadata(state_dict_metadata=state, planner_data=planner, storage_data=storage,
                        version=doc.get("dcp_version"))
    except (UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
        raise CheckpointCorrupt(
            f"{where}: malformed DCP metadata ({type(e).__name__}: {e}); the checkpoint is corrupt"
        ) from e


def merged(metadatas: Iterable[tuple[Metadata, str]]) -> Metadata:
    """One `Metadata` over the chunks of several checkpoints that hold parts of the same tensors
    (the local tier's copies of one step, each rank's shards in a file of its own name: a
    recovery at another world size reads from all of them). A chunk stored in several (a
    replicated tensor every rank's copy holds) is listed once, from the first; `CheckpointCorrupt`
    when two disagree on a tensor's global size or dtype (they are not copies of one state)."""
    state: dict[str, TensorStorageMetadata] = {}
    storage: dict[MetadataIndex, Any] = {}
    planner: dict[str, Any] = {}
    version = None
    for md, where in metadatas:
        version = version or md.version
        planner.update(md.planner_data or {})
        for fqn, meta in md.state_dict_metadata.items():
            assert isinstance(meta, TensorStorageMetadata)  # metadata_from_json and merged list tensors only
            have = state.get(fqn)
            if have is None:
                state[fqn] = have = TensorStorageMetadata(meta.properties, meta.size, [])
            elif (have.size, have.properties.dtype) != (meta.size, meta.properties.dtype):
                raise CheckpointCorrupt(f"{where}: {fqn} is {meta.properties.dtype}{list(meta.size)}, another copy of "
                                        f"the same step has {have.properties.dtype}{list(have.size)}")
            listed = {tuple(c.offsets) for c in have.chunks}
            have.chunks.extend(c for c in meta.chunks if tuple(c.offsets) not in listed)
        for idx, loc in (md.storage_data or {}).items():
            storage.setdefault(idx, loc)
    return Metadata(state_dict_metadata=dict(state), planner_data=planner, storage_data=storage, version=version)


def _ints(values: Any) -> list[int]:
    if not isinstance(values, list) or not all(type(v) is int and v >= 0 for v in values):
        raise ValueError(f"expected a list of non-negative ints, got {values!r}")
    return values


def _in_group() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


@contextmanager
def raising_the_failure() -> Iterator[None]:
    """DCP gathers every rank's failure into one `CheckpointException` (a BaseException, which no
    `except Exception` of the commit or the resume would see) and raises it on every rank; raise
    the failure itself instead, this rank's own if it had one, else the lowest rank's, so a
    damaged shard is a `CheckpointCorrupt` on every rank (the resume tries an older checkpoint)."""
    try:
        yield
    except CheckpointException as e:
        rank = torch.distributed.get_rank() if _in_group() else 0
        failures = e.failures
        error, _ = failures.get(rank) or failures[min(failures)]
        raise error from None


# ---- writing -----------------------------------------------------------------------------------

WriteFile = Callable[[str, Iterable[memoryview | bytes]], "FileRecord"]
"""Writes one named file of the checkpoint from its chunks (durably, hashed): the store's."""


class ShardWriter(StorageWriter):
    """DCP's StorageWriter for one rank: its chunks into `shard_file(rank)`, the coordinator's
    metadata into `METADATA_FILE`, both through `write_file`; `records` after `dcp.save`."""

    def __init__(self, write_file: WriteFile, rank: int, where: str) -> None:
        super().__init__()
        self.write_file, self.rank, self.where = write_file, rank, where
        self.records: list[FileRecord] = []

    def reset(self, checkpoint_id: Any = None) -> None:
        self.records = []

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                raise CheckpointError(f"sharded state {item.index.fqn!r} is not a tensor; DCP would pickle it")
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        file = shard_file(self.rank)
        tensors: dict[str, torch.Tensor] = {}
        results: list[WriteResult] = []
        for item in plan.items:
            t = planner.resolve_data(item)
            # prepare_local_plan refused every BYTE_IO item: each is a tensor
            assert isinstance(t, torch.Tensor) and item.tensor_data is not None
            name = _chunk_name(item.index.fqn, item.tensor_data.chunk.offsets)
            tensors[name] = t.detach()
            results.append(WriteResult(index=item.index, size_in_bytes=t.numel() * t.element_size(),
                                       storage_data=ShardLocation(file, name)))
        if tensors:
            self.records.append(self.write_file(file, serialize(tensors, f"{self.where}/{file}")))
        done: Future[list[WriteResult]] = Future()
        done.set_result(results)
        return done

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        metadata.storage_data = {r.index: r.storage_data for rank_results in results for r in rank_results}
        self.records.append(self.write_file(METADATA_FILE, [metadata_to_json(metadata)]))

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False  # bound to one commit's folder, never chosen by a checkpoint id

    def storage_meta(self) -> None:
        return None  # DCP's save id would make two saves of the same state differ


def save_shards(tensors: Mapping[str, torch.Tensor], write_file: WriteFile, rank: int, where: str,
                group: Any = None, *, own: bool = False) -> list[FileRecord]:
    """Write this rank's share of the sharded tensors (`fqn -> DTensor or tensor`) with DCP's
    `save` and default planner; collective over `group` (every rank calls it at the same point;
    a rank's failure raises on every rank). Returns the records of the files this rank wrote.

    `own`: a checkpoint of this rank's own instead (the local tier): no collective, this rank
    its own coordinator, so it writes its shards, every replicated tensor of the parts and a
    metadata file listing its chunks alone; only this rank, at this world size, can load it
    (`check_fit` refuses a live tensor whose share the stored chunks do not cover)."""
    writer = ShardWriter(write_file, rank, where)
    with warnings.catch_warnings(), raising_the_failure():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # `own`, one process: meant so
        dcp.save(dict(tensors), storage_writer=writer, planner=DefaultSavePlanner(), process_group=group,
                 no_dist=own or not _in_group())
    return writer.records


# ---- reading -----------------------------------------------------------------------------------

OpenFile = Callable[[str], Opened]
"""Opens one file the manifest lists (size and header checked): (reader, header entries, URL)."""


class ShardReader(StorageReader):
    """DCP's StorageReader over a parsed `Metadata`: every chunk a rank needs is read from the
    files through `open_file`, each file once and in offset order (so a hashing reader hashes
    every byte as it streams), straight into the destination when it is the whole chunk."""

    def __init__(self, metadata: Metadata, open_file: OpenFile) -> None:
        super().__init__()
        self.metadata, self.open_file = metadata, open_file

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self.metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        by_file: dict[str, dict[str, list[ReadItem]]] = defaultdict(lambda: defaultdict(list))
        for req in plan.items:
            loc = self.metadata.storage_data.get(req.storage_index)
            if loc is None:
                raise CheckpointCorrupt(f"DCP metadata lists no stored chunk for {req.storage_index.fqn!r}")
            by_file[loc.file][loc.tensor].append(req)
        for file, by_tensor in sorted(by_file.items()):
            f, entries, where = self.open_file(file)
            missing = sorted(set(by_tensor) - set(entries))
            if missing:
                raise CheckpointCorrupt(f"{where}: has no tensor {missing[0]!r}, which the DCP metadata places there")
            for name in sorted(by_tensor, key=lambda n: entries[n].start):
                self._read_chunk(f, entries[name], where, by_tensor[name], planner)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    @staticmethod
    def _read_chunk(f: Readable, entry: TensorEntry, where: str, reqs: list[ReadItem], planner: LoadPlanner) -> None:
        if len(reqs) == 1:
            dest = planner.resolve_tensor(reqs[0]).detach()
            if tuple(dest.shape) == entry.shape and dest.dtype == entry.dtype:  # the whole chunk: no second copy
                read_tensor(f, entry, where, out=dest)
                planner.commit_tensor(reqs[0], dest)
                return
        chunk = read_tensor(f, entry, where)
        for req in reqs:
            part = chunk
            for dim, (start, length) in enumerate(zip(req.storage_offsets, req.lengths, strict=True)):
                part = part.narrow(dim, start, length)
            dest = planner.resolve_tensor(req).detach()
            if dest.shape != part.shape:
                raise CheckpointCorrupt(f"{where}: chunk {entry.name!r} does not fit its destination "
                                        f"({list(part.shape)} vs {list(dest.shape)})")
            dest.copy_(part)
            planner.commit_tensor(req, dest)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False


def check_fit(metadata: Metadata, dest: Mapping[str, torch.Tensor], where: str) -> list[str]:
    """Every way the live tensors `dest` (fqn -> tensor, global shapes) do not fit the sharded
    checkpoint: a tensor it lacks, another shape or dtype, or stored chunks that do not cover
    this rank's share of it (a rank's own checkpoint, `save_shards(own=True)`, loaded into
    another sharding: DCP would leave the uncovered elements as they were)."""
    problems = []
    for fqn, t in dest.items():
        meta = metadata.state_dict_metadata.get(fqn)
        assert meta is None or isinstance(meta, TensorStorageMetadata)  # metadata_from_json, merged: tensors only
        if meta is None:
            problems.append(f"{fqn}: missing from the sharded state of {where}")
        elif tuple(meta.size) != tuple(t.shape) or meta.properties.dtype != t.dtype:
            problems.append(f"{fqn}: checkpoint {str(meta.properties.dtype).removeprefix('torch.')}{list(meta.size)}, "
                            f"live {str(t.dtype).removeprefix('torch.')}{list(t.shape)}")
        elif _covered(*(share := _share(t)), meta.chunks) != math.prod(share[1]):
            offsets, sizes = share
            problems.append(f"{fqn}: the chunks {where} stores do not cover this rank's share (offsets {offsets}, "
                            f"sizes {sizes}); it holds another rank's or another sharding's")
    return problems


def _share(t: torch.Tensor) -> tuple[list[int], list[int]]:
    """(offsets, sizes) of the part of the global tensor `t` that this rank holds."""
    if not is_dtensor(t):
        return [0] * t.dim(), list(t.shape)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    sizes, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return list(offsets), list(sizes)


def _covered(offsets: list[int], sizes: list[int], chunks: Iterable[ChunkStorageMetadata]) -> int:
    """How many elements of the block at `offsets` of `sizes` the stored `chunks` (disjoint, as
    DCP writes them) hold."""
    return sum(math.prod(max(0, min(o + s, co + cs) - max(o, co))
                         for o, s, co, cs in zip(offsets, sizes, c.offsets, c.sizes, strict=False)) for c in chunks)


def load_shards(metadata: Metadata, dest: Mapping[str, torch.Tensor], open_file: OpenFile) -> None:
    """Fill the live tensors `dest` (fqn -> DTensor or plain tensor: any sharding, any world
    size) in place with DCP's `load` and default planner; collective over the default group when
    there is one. The caller checked the fit (`check_fit`)."""
    with warnings.catch_warnings(), raising_the_failure():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # one process: meant so
        dcp.load(dict(dest), storage_reader=ShardReader(metadata, open_file), planner=DefaultLoadPlanner(),
                 no_dist=not _in_group())


def opened_once(open_tensors: Callable[[ExitStack, str], Opened], stack: ExitStack) -> OpenFile:
    """`open_file` for a `ShardReader`: each file opened once per load, kept open on `stack`."""
    opened: dict[str, Opened] = {}

    def open_file(file: str) -> Opened:
        if file not in opened:
            opened[file] = open_tensors(stack, file)
        return opened[file]

    return open_file
