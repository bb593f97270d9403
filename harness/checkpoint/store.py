"""CheckpointStore: atomic commit, discovery, verification, retention and loading on any fsspec URL.

Layout: `URL/lease.json` (lease.py) and `URL/checkpoints/step-00001200/` holding the data files
(format.py), `state.json`, and `manifest.json` (manifest.py).

Commit protocol. A checkpoint exists only when its manifest exists and every file matches it.
* Local disk: write everything into `step-N.tmp-<writer>-<random>/`, fsync each file, write and
  fsync the manifest, fsync the folder, rename it to `step-N/`, fsync `checkpoints/`. A crash at
  any point leaves either no `step-N/` or a complete one.
* Object stores (`s3://`, `memory://`): no rename, so data objects go straight to `step-N/` and
  the manifest object (one atomic PUT) is written last.
Deleting a checkpoint removes its manifest first, so a half-deleted one is never "found".

Every commit goes through `committing`, the one commit sequence: `begin`, the caller writes the
files, `seal` (or `discard` on any failure), log, retention. `commit` writes a snapshot's files
(format.py's `snapshot_files`) from this process; the group commit (save/group_commit.py) and the
local-first upload (save/local_first.py) write theirs inside the same sequence.

Discovery (`latest_good`) walks committed steps newest first and verifies sizes and digests
(each file's algorithm as its manifest names it) against the manifest; a checkpoint that fails
is logged (file, expected vs found) and skipped.
Reading (loading.py): `open(ref)` reads a checkpoint's manifest and state.json once into a
`Checkpoint`; loading it into the live state is loading.py's `load` (`harness.checkpoint.load`).
A damaged checkpoint raises `CheckpointCorrupt`, one that does not fit a plain
`CheckpointError`; resuming builds a new trainer and tries the next older of `candidates()`
after a `CheckpointCorrupt` only.

Retention runs after each successful commit (and in `gc`): keep the last `keep_last`, every
step divisible by `keep_every` and the newest good checkpoint, and delete none while no good one
exists (retention.py); leftover temporary folders of writers that are not alive (not
this store and not the lease holder) are removed.
"""

from __future__ import annotations

import builtins
import os
import re
import socket
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass, field
from secrets import token_hex
from typing import Any

from harness.checkpoint.discovery import (
    TMP_DIR,
    CheckpointRef,
    candidates,
    checkpoints_dir,
    first_without_problems,
    latest_committed,
    read_manifest,
    ref_at,
    scan,
)
from harness.checkpoint.errors import CheckpointError
from harness.checkpoint.format import Snapshot, capture, snapshot_files
from harness.checkpoint.lease import DEFAULT_HEARTBEAT_S, Lease
from harness.checkpoint.loading import (
    Checkpoint,
    open_checkpoint,
    open_tensors,
    verify_files,
)
from harness.checkpoint.manifest import MANIFEST_FILE, FileRecord, Manifest
from harness.checkpoint.retention import check_policy, steps_to_keep
from harness.checkpoint.shard_files import SHARDED
from harness.checkpoint.tensorfile import TensorEntry
from harness.errors import StorageError, Unavailable
from harness.log import get_logger
from harness.storage.location import (
    Location,
    folder_name,
    fsync_dir,
    open_location,
    rename,
    write_small,
    write_stream,
)

log = get_logger(__name__)


@dataclass
class Commit:
    """A commit in progress (`CheckpointStore.committing`): the checkpoint `ref`, the folder `work`
    its files are written into, and the records of the files written, which the seal lists."""

    ref: CheckpointRef
    work: str
    records: list[FileRecord] = field(default_factory=list)


class CheckpointStore:
    """Checkpoints of one run dir (`url`: a local path or an fsspec URL).

    `keep_last` (>= 2) and `keep_every` (0 = off) set retention; `writer_id` names this writer
    in manifests, temporary folders and the lease (default: host-pid-random); `clock` is
    injectable for the lease's heartbeat arithmetic; `lease_heartbeat_s` is the lease's
    heartbeat interval (lease.py: stale after a few missed ones).
    """

    def __init__(self, url: str, *, keep_last: int = 3, keep_every: int = 0,
                 storage_options: dict[str, Any] | None = None, writer_id: str | None = None,
                 clock: Callable[[], float] = time.time,
                 lease_heartbeat_s: float = DEFAULT_HEARTBEAT_S) -> None:
        check_policy(keep_last, keep_every)
        self.keep_last, self.keep_every, self.clock = keep_last, keep_every, clock
        self.loc: Location = open_location(url, storage_options)
        self.dir = checkpoints_dir(self.loc)
        raw_id = writer_id or f"{socket.gethostname()}-{os.getpid()}-{token_hex(3)}"
        self.writer_id = re.sub(r"[^A-Za-z0-9_.-]", "_", raw_id)
        self._lease = Lease(self.loc, self.writer_id, clock=clock, heartbeat_s=lease_heartbeat_s)

    @property
    def url(self) -> str:
        return self.loc.url

    # ---- discovery -------------------------------------------------------------------------

    def exists(self) -> bool:
        """Whether the run dir exists at all."""
        return bool(self.loc.fs.isdir(self.loc.root))

    def ref(self, step: int) -> CheckpointRef:
        return ref_at(self.loc, step)

    def scan(self) -> tuple[builtins.list[CheckpointRef], builtins.list[str]]:
        """(`list()`, `incomplete()`) from one listing and one manifest check per step folder
        (on an object store each is a request; retention after every save needs both)."""
        return scan(self.loc)

    def list(self) -> builtins.list[CheckpointRef]:
        """Committed checkpoints (a manifest exists; not yet verified), oldest first."""
        return self.scan()[0]

    def incomplete(self) -> builtins.list[str]:
        """Paths of folders that are not checkpoints: temporary folders, step folders without manifest."""
        return self.scan()[1]

    def manifest(self, ref: CheckpointRef) -> Manifest:
        """The parsed manifest of `ref`; `CheckpointCorrupt` when it is missing or malformed."""
        return read_manifest(self.loc, ref)

    def verify(self, ref: CheckpointRef) -> builtins.list[str]:
        """Every problem with `ref` (empty when it is good): each file's size and digest against
        the manifest, the safetensors headers and state.json. Reads every byte."""
        return verify_files(self.loc, ref)

    def candidates(self) -> builtins.list[CheckpointRef]:
        """Committed checkpoints newest first, not yet verified; step folders without a manifest
        (interrupted saves) are logged as ignored."""
        return candidates(self.loc)

    def latest_good(self) -> CheckpointRef | None:
        """The newest checkpoint that verifies fully; bad ones are logged and skipped. None if none."""
        return self.first_good(self.candidates())

    def latest_committed(self) -> CheckpointRef | None:
        """The newest checkpoint whose manifest parses and whose files are all there at the sizes
        it records, found without reading their data (`discovery.latest_committed`): one listing
        and one manifest per candidate, where `latest_good` reads every byte. For watching a
        run's progress; a resume still verifies (`latest_good` or a verified load). None if none."""
        return latest_committed(self.loc)

    def first_good(self, refs: Iterable[CheckpointRef]) -> CheckpointRef | None:
        """The first of `refs` that verifies fully; bad ones are logged and skipped. None if none."""
        return first_without_problems(refs, self.verify)

    # ---- writing ---------------------------------------------------------------------------

    def save(self, step: int, parts: Mapping[str, Any], *, meta: Mapping[str, Any] | None = None,
             per_rank: Collection[str] = ()) -> CheckpointRef:
        """`commit(step, capture(parts, per_rank=per_rank), meta=meta)`."""
        return self.commit(step, capture(parts, per_rank=per_rank), meta=meta)

    def commit(self, step: int, snapshot: Snapshot, *, meta: Mapping[str, Any] | None = None,
               own_shards: bool = False) -> CheckpointRef:
        """Serialize, hash, write and atomically commit `snapshot` as `step`, then apply retention.

        Data files are byte-identical for the same snapshot, step and meta. A checkpoint already
        committed at `step` is replaced (its manifest is removed first). Raises `CheckpointError`
        if this store held the lease and lost it.

        A snapshot with sharded parts (FSDP) is committed by every rank of its group
        (checkpoint/save/group_commit.py) and refused here, unless `own_shards`: then it becomes
        this rank's own checkpoint, its shards alone beside every other file (`write_shards`
        with `own`; the local tier), which only this rank at this world size can load.
        """
        if SHARDED in snapshot.tensors and not own_shards:
            raise CheckpointError("a snapshot with sharded parts (FSDP) is committed by every rank of its group "
                                  "(checkpoint/save/group_commit.py: GroupCommit), not by one process")

        with self.committing(step) as commit:
            commit.records += self.write_shards(commit.work, commit.ref, snapshot, own=True)
            commit.records += [self.write_file(commit.work, commit.ref, name, chunks)
                               for name, chunks in snapshot_files(step, snapshot, meta, commit.ref.url)]
        return commit.ref

    @contextmanager
    def committing(self, step: int, **log_fields: Any) -> Iterator[Commit]:
        """The one commit sequence, around the caller's writes: `begin`; the block writes every
        file into `commit.work` (`write_file`) and adds its record to `commit.records`; then
        `seal`. On any failure, in the block or sealing, `discard` and raise. After the seal: the
        "checkpoint committed" log record (with `log_fields` added), then retention."""
        started = time.perf_counter()
        ref, work = self.begin(step)
        commit = Commit(ref, work)
        try:
            yield commit
            manifest = self.seal(ref, work, commit.records)
        except BaseException:
            self.discard(work)
            raise
        log.info("checkpoint committed", step=step, url=ref.url, bytes=manifest.nbytes,
                 seconds=round(time.perf_counter() - started, 3), **log_fields)
        self.gc(newest_good=step)

    # The steps of `committing`; `write_file` also for the ranks of a group that write into the
    # folder rank 0 began (checkpoint/save/group_commit.py).

    def begin(self, step: int) -> tuple[CheckpointRef, str]:
        """Start a commit of `step`: (its ref, the folder its files are written into). Local disk:
        a fresh temporary folder; object stores: the step folder itself, its manifest removed."""
        if type(step) is not int or step < 0:
            raise CheckpointError(f"checkpoint step must be a non-negative int, got {step!r}")
        if self._lease.held:
            self._lease.check()
        ref = self.ref(step)
        if self.loc.is_local:
            work = f"{ref.path}.tmp-{self.writer_id}-{token_hex(4)}"
            self.loc.fs.makedirs(work, exist_ok=True)
            return ref, work
        # One request: an object store has no folders to make (s3fs's makedirs asked whether the
        # bucket exists; a missing one fails the first write, harness/storage/retry.py says how), and removing
        # a manifest that is not there is no error (asking first took two more).
        with suppress(FileNotFoundError):
            self.loc.fs.rm(f"{ref.path}/{MANIFEST_FILE}")
        return ref, ref.path

    def write_file(self, work: str, ref: CheckpointRef, name: str, chunks: Iterable[memoryview | bytes]) -> FileRecord:
        """Write one file of the checkpoint `ref` into `work` (durably on local disk)."""
        size, digest = write_stream(self.loc, f"{work}/{name}", chunks)
        return FileRecord(name, size, digest)

    def write_shards(self, work: str, ref: CheckpointRef, snapshot: Snapshot, *, group: Any = None,
                     own: bool = False) -> builtins.list[FileRecord]:
        """Write this rank's shards of the sharded parts of `snapshot` (none: nothing) into `work`
        through DCP (checkpoint/dcp.py `save_shards`: collective over `group`, or with `own` this
        rank's checkpoint alone); the records of the files written."""
        if SHARDED not in snapshot.tensors:
            return []
        from harness.checkpoint.dcp import save_shards  # DCP: only sharded runs load it (shard_files.py)

        return save_shards(snapshot.tensors[SHARDED], lambda name, chunks: self.write_file(work, ref, name, chunks),
                           snapshot.rank, ref.url, group=group, own=own)

    def seal(self, ref: CheckpointRef, work: str, records: builtins.list[FileRecord]) -> Manifest:
        """The commit point: write the manifest listing `records`; on local disk fsync and rename
        `work` to the step folder (replacing a committed one)."""
        manifest = Manifest(step=ref.step, files=tuple(sorted(records, key=lambda r: r.name)),
                            created=self.clock(), writer=self.writer_id)
        write_small(self.loc, f"{work}/{MANIFEST_FILE}", manifest.to_bytes())
        if self.loc.is_local:
            fsync_dir(self.loc, work)
            if self.loc.fs.exists(ref.path):
                self.delete(ref)
            rename(self.loc, work, ref.path)
            fsync_dir(self.loc, self.dir)
        return manifest

    def discard(self, work: str) -> None:
        """Abandon an unsealed commit: remove its temporary folder (local disk; on object stores
        the files without a manifest are not a checkpoint and retention removes them)."""
        if self.loc.is_local:
            self.loc.fs.remove_tree(work)

    def delete(self, ref: CheckpointRef) -> None:
        """Remove a checkpoint, manifest first, so it stops existing before its data goes. What is
        already gone is no error (asked by removing, not by checking first: on an object store
        every check is a request, and retention runs after every save)."""
        with suppress(FileNotFoundError):
            self.loc.fs.rm(f"{ref.path}/{MANIFEST_FILE}")
        if self.loc.is_local:
            self.loc.fs.remove_tree(ref.path)
        else:
            with suppress(FileNotFoundError):
                self.loc.fs.rm(ref.path, recursive=True)

    def gc(self, newest_good: int | None = None, *, dry_run: bool = False) -> builtins.list[str]:
        """Apply retention and remove leftovers of dead writers; returns the URLs removed (with
        `dry_run`, the URLs it would remove, removing nothing). `newest_good`: the step of a
        checkpoint known to be good (one just committed); unset, the newest that verifies is
        looked for (reading checkpoints newest first). Retention keeps it and deletes nothing
        while there is none (retention.py)."""
        removed = []
        committed, incomplete = self.scan()
        if newest_good is None:
            newest_good = getattr(self.first_good(committed[::-1]), "step", None)
        keep = steps_to_keep([r.step for r in committed], self.keep_last, self.keep_every, newest_good)
        for ref in committed:
            if ref.step not in keep:
                if not dry_run:
                    self.delete(ref)
                removed.append(ref.url)
        temporary = any(TMP_DIR.fullmatch(folder_name(path)) for path in incomplete)
        alive = self._live_writers() if temporary else set()
        for path in incomplete:  # listed before the deletes: those removed whole checkpoints only
            tmp = TMP_DIR.fullmatch(folder_name(path))
            if tmp is not None and tmp[2] in alive:
                continue
            if not dry_run:
                self.loc.fs.rm(path, recursive=True)
            removed.append(self.loc.url_of(path))
        if removed and not dry_run:
            log.info("checkpoint retention removed", paths=removed)
        return removed

    def _live_writers(self) -> set[str]:
        """This store's writer and the lease holder, if its lease is live: their temporary folders
        may be a save in progress."""
        alive = {self.writer_id}
        holder = self._lease.read()
        if holder is not None and self._lease.gone_reason(holder) is None:
            alive.add(str(holder["owner"]))
        return alive

    # ---- reading ---------------------------------------------------------------------------

    def open(self, ref: CheckpointRef) -> Checkpoint:
        """`ref` with its manifest and state.json read and parsed once (loading.py);
        `CheckpointCorrupt` when either is missing, malformed or does not match."""
        return open_checkpoint(self.loc, ref)

    def read_state(self, ref: CheckpointRef) -> dict[str, Any]:
        """`state.json` of `ref` (tensor leaves are `{"$tensor": [file, name]}` references),
        checked against the manifest's digest. Keys: format_version, step, rank, parts, meta."""
        return self.open(ref).state

    def tensor_headers(self, ref: CheckpointRef) -> dict[str, dict[str, TensorEntry]]:
        """File name -> tensor name -> entry, for every tensor file of `ref` (headers only)."""
        with self.open_tensor_files(ref) as files:
            return {name: entries for name, (_, entries, _) in files.items()}

    @contextmanager
    def open_tensor_files(self, ref: CheckpointRef) -> Iterator[dict[str, tuple[Any, dict[str, TensorEntry], str]]]:
        """Open every tensor file of `ref`: file name -> (reader, header entries, URL)."""
        with ExitStack() as stack:
            yield {rec.name: open_tensors(self.loc, stack, ref, rec)
                   for rec in self.manifest(ref).files if rec.name.endswith(".safetensors")}

    # ---- lease -----------------------------------------------------------------------------

    def acquire_lease(self, takeover: bool = False) -> None:
        """Become the run dir's only writer, or raise `CheckpointError` naming the holder, and
        heartbeat from a thread until `release_lease`. On an object store, multipart uploads that
        earlier writers left open (killed mid-upload) are aborted: nothing else writes here now."""
        self._lease.acquire(takeover=takeover)
        self._lease.start_heartbeat()
        abort_uploads = getattr(self.loc.fs, "abort_uploads", None)
        if abort_uploads is None:
            return
        try:
            aborted = abort_uploads(self.dir)
        except StorageError as e:  # a cleanup: never a reason not to train
            log.warning("could not abort multipart uploads left open by earlier writers (needs "
                        "s3:ListBucketMultipartUploads); an AbortIncompleteMultipartUpload lifecycle rule "
                        "on the bucket cleans them up instead", error=str(e)[:300])
            return
        if aborted:
            log.warning("aborted multipart uploads left open by an earlier writer", keys=aborted)

    def poll_lease(self) -> None:
        """Raise what stopped the lease's heartbeats (lost lease: `CheckpointError`; storage
        outage: `StorageUnavailable`); cheap enough to call every step."""
        self._lease.poll()

    def release_lease(self) -> None:
        """Give the lease up. When the storage does not answer, the lease is left as it is (it
        goes stale; a restart on this host sees this process gone) and the outage is logged, so
        the error that ended the run stays the one reported."""
        try:
            self._lease.release()
        except Unavailable as e:
            log.warning("could not release the run dir lease: the storage is unavailable; the next start "
                        "takes it over", error=str(e)[:300])

    @contextmanager
    def lease(self, takeover: bool = False) -> Iterator[CheckpointStore]:
        self.acquire_lease(takeover=takeover)
        try:
            yield self
        finally:
            self.release_lease()
