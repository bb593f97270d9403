"""Reading one committed checkpoint: its manifest and state parsed once, then loaded into live parts.

`verify_files(loc, ref)` lists every problem of a checkpoint (reads every byte: discovery; the
ones that show without reading data are discovery.py's `check_sizes`).
`open_checkpoint(loc, ref)` reads `manifest.json` and `state.json` (checked against the
manifest's digest) once and returns a `Checkpoint` holding both parsed; everything after that
(the config check of a resume, a rank's own state file, the load) takes that object, so a resume
reads each small file once (one GET each on S3) and no two reads can disagree.

`load(loc, checkpoint, targets, rank=, world=, ...)` streams the tensors into the live state
(into_live.py), every rank its own per-rank parts: the one way a checkpoint is loaded (a resume at
any world size, from either tier, a rollback, `harness.testing`). How much it re-hashes is a `Verify`:
* `NO`: sizes and headers only (the checkpoint was verified already, e.g. by `latest_good`);
* `BEFORE`: every file hashed first, so a corrupt checkpoint changes nothing;
* `WHILE`: every byte hashed as it streams into the live state, so a verified resume reads the
  checkpoint once. A mismatch raises `CheckpointCorrupt` before any part's `load_state_dict`,
  with the live tensors already overwritten (the caller discards them).

Errors say which kind they are, so a caller never re-reads a checkpoint to classify one: a
missing, malformed or mismatching file is `CheckpointCorrupt` (the checkpoint is damaged: try an
older one); a checkpoint that is intact but does not fit the live state is a plain
`CheckpointError` (the setup is wrong). With `WHILE`, a fit problem is raised only after the
bytes read so far and the rest of every file were hashed: a damaged header that looks like
another shape is reported as damage.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any

from harness.checkpoint.discovery import CheckpointRef, read_manifest, size_problem
from harness.checkpoint.errors import CheckpointCorrupt
from harness.checkpoint.format import WORLD_SIZE_KEY, parse_state, rank_state_file, tensor_refs
from harness.checkpoint.into_live import OpenTensors, restore_parts
from harness.checkpoint.manifest import STATE_FILE, FileRecord, Manifest
from harness.checkpoint.shard_files import MAX_METADATA_BYTES, METADATA_FILE
from harness.checkpoint.tensorfile import Opened, TensorEntry, read_header
from harness.errors import StorageError
from harness.log import get_logger
from harness.storage.digest import hexdigest
from harness.storage.location import HashingReader, Location, check_small, hash_file, open_read, read_bytes

if TYPE_CHECKING:  # DCP: imported only by sharded loads (CheckpointShards)
    from torch.distributed.checkpoint.metadata import Metadata

log = get_logger(__name__)

MAX_STATE_BYTES = 1 << 30


class Verify(Enum):
    """How much of a checkpoint `load` re-hashes (see the module docstring)."""

    NO = "no"
    BEFORE = "before"
    WHILE = "while"


@dataclass(frozen=True)
class Checkpoint:
    """A committed checkpoint read once: its ref, parsed manifest and parsed `state.json`
    (keys: format_version, step, rank, parts, meta; tensor leaves are `{"$tensor": [file, name]}`)."""

    ref: CheckpointRef
    manifest: Manifest
    state: dict[str, Any]

    @property
    def records(self) -> dict[str, FileRecord]:
        return {r.name: r for r in self.manifest.files}

    @property
    def sharded(self) -> bool:
        """Whether parts of it were written sharded (FSDP: every rank its shards, through DCP)."""
        return METADATA_FILE in self.records

    @property
    def tensor_files(self) -> list[str]:
        """The tensor files state.json refers to, in the order of their first reference (the
        order a load opens them in; not the sharded parts' files, which DCP plans)."""
        files = [file for part in self.state["parts"].values() for file, _ in tensor_refs(part).values()]
        return [file for file in dict.fromkeys(files) if file in self.records]


def read_state_file(loc: Location, ref: CheckpointRef, manifest: Manifest, file: str = STATE_FILE) -> dict[str, Any]:
    """A state file of `ref` (`state.json`, or a rank's `rank-NNNNN.json` of the same layout),
    parsed after checking its bytes against the manifest's record; `CheckpointCorrupt` otherwise."""
    where = loc.url_of(f"{ref.path}/{file}")
    try:
        return parse_state(read_listed(loc, ref, manifest, file, MAX_STATE_BYTES), where)
    except CheckpointCorrupt:
        raise
    except StorageError as e:
        raise CheckpointCorrupt(str(e)) from e


def read_listed(loc: Location, ref: CheckpointRef, manifest: Manifest, file: str, limit: int) -> bytes:
    """The bytes of a small file of `ref`, after checking them against the manifest's record;
    `CheckpointCorrupt` when it is not listed, missing, too large or does not match."""
    records = {r.name: r for r in manifest.files}
    path = f"{ref.path}/{file}"
    where = loc.url_of(path)
    if file not in records:
        raise CheckpointCorrupt(f"{where}: not listed in the manifest; the checkpoint was not written by this setup")
    rec = records[file]
    if not loc.fs.exists(path):
        raise CheckpointCorrupt(f"{where}: missing; the checkpoint is incomplete")
    try:
        data = read_bytes(loc, path, limit)
    except StorageError as e:
        raise CheckpointCorrupt(str(e)) from e
    if len(data) != rec.size:
        raise CheckpointCorrupt(f"{where}: does not match the manifest ({len(data)} bytes, manifest says "
                                f"{rec.size}); the checkpoint is corrupt")
    if hexdigest(rec.algorithm, data) != rec.digest:
        raise CheckpointCorrupt(f"{where}: does not match the manifest (its {rec.algorithm} digest differs, the "
                                f"size is right: changed bytes); the checkpoint is corrupt")
    return data


def verify_files(loc: Location, ref: CheckpointRef) -> list[str]:
    """Every problem with `ref` (empty when it is good): each file's size and digest against
    the manifest, the safetensors headers and state.json. Reads every byte."""
    try:
        manifest = read_manifest(loc, ref)
    except StorageError as e:
        return [str(e)]
    problems = []
    started = time.perf_counter()
    for rec in manifest.files:
        path = f"{ref.path}/{rec.name}"
        where = loc.url_of(path)
        size = loc.fs.size(path) if loc.fs.exists(path) else None
        if size != rec.size:
            problems.append(size_problem(where, rec, size))
            continue
        # One pass over each file: its header or contents are checked through the hashing
        # reader (a second read of the header was a second GET of a whole block on S3).
        with HashingReader(open_read(loc, path, prefetch=True), rec.algorithm) as reader:
            try:
                _check_content(reader, rec, where)
                content_problem = None
            except StorageError as e:
                content_problem = str(e)
            size, digest = reader.finish()
        if size != rec.size:
            problems.append(size_problem(where, rec, size))
        elif digest != rec.digest:
            problems.append(f"{where}: {rec.algorithm} {digest}, the manifest says {rec.digest}")
        elif content_problem:
            problems.append(content_problem)
    log.debug("checkpoint verified", url=ref.url, files=len(manifest.files), bytes=manifest.nbytes,
              problems=len(problems), seconds=round(time.perf_counter() - started, 3))
    return problems


def _check_content(reader: HashingReader, rec: FileRecord, where: str) -> None:
    """Parse what `reader` (at the start of the file `rec`, of `rec.size` bytes) holds: a
    safetensors header, or the whole of a state or DCP metadata file; `CheckpointError` if it
    does not parse."""
    if rec.name.endswith(".safetensors"):
        read_header(reader, rec.size, where)
    elif rec.name == STATE_FILE:
        check_small(where, rec.size, MAX_STATE_BYTES)
        parse_state(reader.read(rec.size), where)
    elif rec.name == METADATA_FILE:
        from harness.checkpoint.dcp import metadata_from_json  # DCP: only sharded checkpoints load it

        check_small(where, rec.size, MAX_METADATA_BYTES)
        metadata_from_json(reader.read(rec.size), where)


class CheckpointShards:
    """The sharded tensors of one checkpoint, or of the copies of one step that together hold
    them (restore.ShardedSource): `copies` are (location, checkpoint, open_file) each, whose DCP
    metadata is read once, checked against its manifest (JSON), and merged (`dcp.merged`); each
    shard file is opened through the `open_file` of the copy whose manifest lists it (size and
    header checked, hashed while read when that load verifies). Built only for a checkpoint with
    sharded parts: it imports DCP (checkpoint/shard_files.py says why nothing else does)."""

    def __init__(self, copies: Sequence[tuple[Location, Checkpoint, OpenTensors]]) -> None:
        from harness.checkpoint import dcp

        self.copies = copies
        self._dcp = dcp
        self._metadata: Metadata | None = None

    @property
    def metadata(self) -> Metadata:
        if self._metadata is None:
            read = []
            for loc, checkpoint, _ in self.copies:
                where = loc.url_of(f"{checkpoint.ref.path}/{METADATA_FILE}")
                data = read_listed(loc, checkpoint.ref, checkpoint.manifest, METADATA_FILE, MAX_METADATA_BYTES)
                read.append((self._dcp.metadata_from_json(data, where), where))
            self._metadata = read[0][0] if len(read) == 1 else self._dcp.merged(read)
        return self._metadata

    def check(self, dest: Mapping[str, Any]) -> list[str]:
        return self._dcp.check_fit(self.metadata, dest, " + ".join(c.ref.url for _, c, _ in self.copies))

    def load(self, stack: ExitStack, dest: Mapping[str, Any]) -> None:
        owners = {name: open_file for _, checkpoint, open_file in self.copies for name in checkpoint.records}

        def open_file(s: ExitStack, file: str) -> Opened:
            if file not in owners:
                raise CheckpointCorrupt(f"the DCP metadata places chunks in {file!r}, which no copy's manifest lists")
            return owners[file](s, file)

        self._dcp.load_shards(self.metadata, dest, self._dcp.opened_once(open_file, stack))


def _shards(loc: Location, checkpoint: Checkpoint, open_file: OpenTensors,
            copies: Sequence[tuple[Location, Checkpoint]]) -> CheckpointShards | None:
    """Where `load` reads the sharded tensors from: `checkpoint` itself, or the `copies`."""
    if not copies:
        return CheckpointShards([(loc, checkpoint, open_file)]) if checkpoint.sharded else None

    def opener(copy_loc: Location, copy: Checkpoint) -> OpenTensors:
        return lambda stack, file: open_tensors(copy_loc, stack, copy.ref, copy.records[file], prefetch=True)

    return CheckpointShards([(copy_loc, copy, opener(copy_loc, copy)) for copy_loc, copy in copies])


def open_checkpoint(loc: Location, ref: CheckpointRef) -> Checkpoint:
    """`ref` with its manifest and `state.json` read and parsed, once; `CheckpointCorrupt` when
    either is missing, malformed or does not match."""
    manifest = read_manifest(loc, ref)
    return Checkpoint(ref, manifest, read_state_file(loc, ref, manifest))


def open_tensors(loc: Location, stack: ExitStack, ref: CheckpointRef, rec: FileRecord, *, prefetch: bool = False,
                 hashing: bool = False) -> tuple[Any, dict[str, TensorEntry], str]:
    """Open the tensor file `rec` of `ref` (its size checked, its header read): (reader, header
    entries, URL). `hashing`: the reader hashes every byte it passes (`HashingReader`)."""
    path = f"{ref.path}/{rec.name}"
    where = loc.url_of(path)
    if not loc.fs.exists(path):
        raise CheckpointCorrupt(f"{where}: missing; the checkpoint is incomplete, resume from an older one")
    size = loc.fs.size(path)
    if size != rec.size:
        raise CheckpointCorrupt(f"{where}: {size} bytes, the manifest says {rec.size}; the file is damaged, resume "
                                f"from an older checkpoint")
    f = open_read(loc, path, prefetch=prefetch)
    f = stack.enter_context(HashingReader(f, rec.algorithm) if hashing else f)
    try:
        return f, read_header(f, size, where), where
    except StorageError as e:
        raise CheckpointCorrupt(str(e)) from e


def load(loc: Location, checkpoint: Checkpoint | CheckpointRef, targets: Mapping[str, Any], *, rank: int = 0,
         world: int = 1, skip: Collection[str] = (), verify: Verify = Verify.NO,
         kept_on_new_rank: Collection[str] = (), one_rank: bool = False,
         shard_copies: Sequence[tuple[Location, Checkpoint]] = ()) -> dict[str, Any]:
    """Restore each target (name -> object with state_dict/load_state_dict) from `checkpoint`
    (a ref, or one opened already: `open_checkpoint`) as rank `rank` of a world of `world`
    (see into_live.py for the checks, the module docstring for `verify`); returns the saved meta.

    Which per-rank parts a rank loads: those in state.json when it is this rank's own (every
    checkpoint's rank 0; a local tier's copy of its rank); else, for a rank of the saving run,
    its `rank-NNNNN.json`; a rank the saving run did not have takes rank 0's, except the parts in
    `kept_on_new_rank`, which keep their live values (harness/run/state.py: the data cursor is
    taken, since it counts the samples of all ranks together and re-splits for any world size;
    the freshly seeded RNG is kept). `one_rank`: the checkpoint is one rank's copy (the local
    tier's), holding its owner's per-rank parts alone: a rank other than its owner takes them as a
    rank new to the run would (checkpoint/save/coverage.py says when that is right).
    `shard_copies`: the local tier's copies of the same step whose shards, together, hold the
    sharded parts (a recovery at another world size or rank: every owner's copy); the sharded
    tensors are read from them instead of from `checkpoint` alone, unhashed (the caller verified
    each, every byte, as the local tier does before it loads a copy). Whether a world size other
    than the saving run's keeps the run bitwise is the caller's to say (harness/run/elastic.py
    knows the mode)."""
    if isinstance(checkpoint, CheckpointRef):
        checkpoint = open_checkpoint(loc, checkpoint)
    ref = checkpoint.ref
    saved_world = int(checkpoint.state["meta"].get(WORLD_SIZE_KEY, 1))
    state, new_rank = _state_of_rank(loc, checkpoint, rank, saved_world, one_rank)
    if new_rank:  # e.g. its own freshly seeded RNG streams rather than a copy of rank 0's
        skip = (*skip, *kept_on_new_rank)
    if verify is Verify.BEFORE and (problems := verify_files(loc, ref)):
        raise CheckpointCorrupt(f"{ref.url} fails verification:\n  " + "\n  ".join(problems))
    files = _TensorFiles(loc, checkpoint, hashing=verify is Verify.WHILE)
    restore_parts(state, targets, skip, files.open,
                  where=f"checkpoint {ref.url}", check_streamed=files.check_streamed if files.hashing else None,
                  sharded=_shards(loc, checkpoint, files.open, shard_copies))
    meta: dict[str, Any] = state["meta"]
    return meta


def _state_of_rank(loc: Location, checkpoint: Checkpoint, rank: int, saved_world: int,
                   one_rank: bool) -> tuple[dict[str, Any], bool]:
    """(the state rank `rank` loads, whether it is new to the saving run): `checkpoint.state` when
    it holds this rank's own per-rank parts; for another rank of the saving run (`saved_world`
    ranks) that state with the parts of its `rank-NNNNN.json` over rank 0's; otherwise (a rank the
    run did not have, or any rank but the owner of a `one_rank` copy) rank 0's parts, and True:
    `load` keeps the live values of its `kept_on_new_rank` parts."""
    state = checkpoint.state
    if state.get("rank", 0) == rank:  # state.json holds rank 0's per-rank parts
        return state, False
    if rank < saved_world and not one_rank:
        own = read_state_file(loc, checkpoint.ref, checkpoint.manifest, rank_state_file(rank))["parts"]
        return {**state, "parts": {**state["parts"], **own}}, False
    return state, True


class _TensorFiles:
    """The tensor files one `load` of `checkpoint` opens (`open`, into_live.py's OpenTensors). With
    `hashing`, each is hashed as it streams, and `check_streamed` then compares every file of the
    manifest with its record."""

    def __init__(self, loc: Location, checkpoint: Checkpoint, hashing: bool) -> None:
        self.loc, self.ref, self.records, self.hashing = loc, checkpoint.ref, checkpoint.records, hashing
        self.readers: dict[str, HashingReader] = {}  # file -> the hashing reader it was opened through

    def open(self, stack: ExitStack, file: str) -> Opened:
        """(reader, header entries, URL) of the safetensors file `file`, opened in `stack`;
        `CheckpointCorrupt` when the manifest does not list it as one."""
        if file not in self.records or not file.endswith(".safetensors"):
            raise CheckpointCorrupt(f"{self.ref.url}: state.json refers to {file!r}, which the manifest does not "
                                    f"list; the checkpoint is corrupt")
        f, entries, where = open_tensors(self.loc, stack, self.ref, self.records[file], prefetch=True,
                                         hashing=self.hashing)
        if self.hashing:
            self.readers[file] = f
        return f, entries, where

    def check_streamed(self) -> None:
        """`CheckpointCorrupt` naming every file whose size or digest is not the manifest's: a file
        opened is finished through its reader (the rest of its bytes hashed), any other read and
        hashed now; state.json is skipped (`open_checkpoint` compared its bytes with the manifest)."""
        problems = []
        for rec in self.records.values():
            path = f"{self.ref.path}/{rec.name}"
            size: int | None
            digest: str | None
            if rec.name in self.readers:
                size, digest = self.readers[rec.name].finish()
            elif rec.name == STATE_FILE:
                continue
            else:
                size, digest = hash_file(self.loc, path, rec.algorithm) if self.loc.fs.exists(path) else (None, None)
            if (size, digest) != (rec.size, rec.digest):  # (None, None): the file is missing
                found = f"{size} bytes with {rec.algorithm} {digest}"  # in the words of FileRecord.describe
                problems.append(f"{self.loc.url_of(path)}: {found}, the manifest says {rec.describe()}")
        if problems:
            raise CheckpointCorrupt(f"{self.ref.url} is corrupt, found while loading it:\n  " + "\n  ".join(problems))
