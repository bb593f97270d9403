"""One checkpoint written by every rank of a process group.

The trade-off first: every rank writes only what is its own, and one process (rank 0) decides
whether the checkpoint exists. Replicated state (model, optimizer, schedulers, counters) is
identical on every rank under DDP, so rank 0 alone writes it; per-rank state (RNG streams; the
data cursor, which is global and the same everywhere but cheap) is written by each rank; the
manifest is the commit point, written last and by rank 0 only, so a failure of any rank at any
moment before it leaves no checkpoint at all, and the previous one stays the newest good one.

Commit (`GroupCommit`, a `Committer`; every rank calls it at the same step, the step loop agrees
on that). Rank 0 runs the store's one commit sequence (`store.committing`) and writes inside it
through the group:
1. rank 0 begins (`store.begin`: a fresh temporary folder on local disk, the step folder on an
   object store) and broadcasts the folder; a failure there is raised on every rank.
2. each rank writes its files into that folder: rank 0 exactly what a single process writes
   (`<part>.safetensors`, `rank-00000.safetensors`, `state.json` with rank 0's per-rank trees);
   rank r > 0 `rank-NNNNN.safetensors` (the tensors of its per-rank parts) and `rank-NNNNN.json`
   (their JSON side, in the layout of state.json). Under FSDP the sharded parts (model,
   optimizer) are no replicated files: every rank writes its shards with DCP's `save`
   (`shards-NNNNN.safetensors`, rank 0 also `dcp-metadata.json`; checkpoint/dcp.py), a
   collective on the same group, before its other files.
3. the ranks gather each rank's outcome: its file records (size, digest), or its error.
4. rank 0 seals (manifest listing every rank's files, fsync, rename; then retention) only if
   every rank succeeded; otherwise it discards the folder. It broadcasts the result, and every
   rank returns the same ref or raises. A killed rank makes the others fail in the next
   collective, before any manifest exists.
Saving in the background (`AsyncSaver(GroupCommit(store, group=side))`, saver.py): each rank
stages only what it writes (`mine`: everything on rank 0, its own per-rank parts on the others)
and runs this same commit in its persist thread, with every collective
on `group`, a second gloo group (`distributed.new_side_group`). The main group stays the step
loop's alone, so a commit in flight never interleaves with a training all-reduce; the ranks'
persists run in the same order on every rank (the step loop agrees on every save, and on
skipping one), so the side group's collectives match up.

Loading it back, every rank its own per-rank parts at any world size, is loading.py's `load`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from harness.checkpoint.discovery import CheckpointRef
from harness.checkpoint.format import WORLD_SIZE_KEY, Snapshot, rank_file, snapshot_files
from harness.checkpoint.manifest import FileRecord
from harness.checkpoint.save.commit import Committer
from harness.checkpoint.store import CheckpointStore
from harness.log import get_logger
from harness.parallel import distributed

log = get_logger(__name__)


class CommitAborted(RuntimeError):
    """Another rank failed to write its part of a checkpoint; nothing was committed."""


# What each rank reports after writing its files: (True, its file records) or (False, its error).
Outcome = tuple[bool, Any]


class GroupCommit(Committer):
    """Commits a snapshot by every rank of the process group (the plain store commit without one).

    `group`: the process group of the commit's collectives (default: the main one; a side group
    when it runs in a background thread). `fail_rank`, `fail_step`: the test hook
    `debug.fail_save_rank` / `debug.fail_save_step`: that rank fails half-way through writing its
    tensor file (at every save, or only at `fail_step`).
    """

    def __init__(self, store: CheckpointStore, *, group: Any = None, fail_rank: int | None = None,
                 fail_step: int | None = None) -> None:
        super().__init__(store)
        self.group, self.fail_rank, self.fail_step = group, fail_rank, fail_step

    def mine(self, snapshot: Snapshot) -> Snapshot:
        """The part of `snapshot` its rank writes: all of it on rank 0; on rank r > 0 its own
        per-rank parts (what `_write_own` reads), so a background save stages no copy of the
        replicated state there."""
        return snapshot if snapshot.rank == 0 else snapshot.own()

    def __call__(self, step: int, snapshot: Snapshot, *, meta: Mapping[str, Any] | None = None) -> CheckpointRef:
        if not distributed.is_distributed():
            return self.store.commit(step, snapshot, meta=meta)
        meta = {**(meta or {}), WORLD_SIZE_KEY: distributed.world()}
        if distributed.rank() == 0:
            return self._lead(step, snapshot, meta)
        return self._follow(step, snapshot, meta)

    def _lead(self, step: int, snapshot: Snapshot, meta: dict[str, Any]) -> CheckpointRef:
        """Rank 0: the store's commit sequence, writing through the group; every other rank
        waits in a broadcast for the folder, then for the outcome (sealed, or discarded)."""
        try:
            with self.store.committing(step, ranks=distributed.world()) as commit:
                distributed.broadcast_object((True, (commit.ref, commit.work)), group=self.group)
                outcomes, failure = self._write_and_gather(commit.ref, commit.work, snapshot, meta)
                if failure is not None:
                    raise failure
                aborted = _aborted(outcomes, step)
                if aborted is not None:
                    raise aborted
                commit.records += [rec for _, recs in outcomes for rec in recs]
        except Exception as e:
            # After `discard`: the folder is gone before any rank reports the failure.
            distributed.broadcast_object((False, distributed.failure_of(e)), group=self.group)
            raise
        distributed.broadcast_object((True, commit.ref), group=self.group)
        return commit.ref

    def _follow(self, step: int, snapshot: Snapshot, meta: dict[str, Any]) -> CheckpointRef:
        ok, begun = distributed.broadcast_object(None, group=self.group)
        if not ok:  # rank 0 could not begin
            raise distributed.raised_elsewhere(begun)
        ref, work = begun
        outcomes, failure = self._write_and_gather(ref, work, snapshot, meta)
        ok, result = distributed.broadcast_object(None, group=self.group)
        if failure is not None:
            raise failure
        aborted = _aborted(outcomes, step)
        if aborted is not None:
            raise aborted
        if not ok:  # rank 0 could not seal
            raise distributed.raised_elsewhere(result)
        committed: CheckpointRef = result  # rank 0 sealed: what it broadcast is its commit.ref
        return committed

    def _write_and_gather(self, ref: CheckpointRef, work: str, snapshot: Snapshot,
                          meta: dict[str, Any]) -> tuple[list[Outcome], Exception | None]:
        """Write this rank's files, then every rank's outcome: (outcomes by rank, this rank's error)."""
        try:
            mine: Outcome = (True, self._write_own(ref, work, snapshot, meta))
            failure = None
        except Exception as e:  # noqa: BLE001 - reported to every rank, then re-raised by the caller
            mine, failure = (False, f"{type(e).__name__}: {e}"), e
        return distributed.all_gather_object(mine, group=self.group), failure

    def _write_own(self, ref: CheckpointRef, work: str, snapshot: Snapshot, meta: dict[str, Any]) -> list[FileRecord]:
        rank = snapshot.rank
        # Every rank its own shards first, through DCP (a collective on the group).
        records = self.store.write_shards(work, ref, snapshot, group=self.group)
        for file, chunks in snapshot_files(ref.step, snapshot, meta, ref.url, own=rank != 0):
            if file == rank_file(rank) and self._failing(rank, ref.step):
                chunks = _fail_after_first(chunks, rank, ref.step)
            records.append(self.store.write_file(work, ref, file, chunks))
        return records

    def _failing(self, rank: int, step: int) -> bool:
        return self.fail_rank == rank and self.fail_step in (None, step)


def _aborted(outcomes: list[Outcome], step: int) -> CommitAborted | None:
    failed = [(r, err) for r, (ok, err) in enumerate(outcomes) if not ok]
    if not failed:
        return None
    r, err = failed[0]
    return CommitAborted(f"rank {r} failed to write its part of the checkpoint at step {step} ({err}); nothing "
                         f"was committed, the previous checkpoint is still the newest good one")


def _fail_after_first(chunks: Iterable[memoryview | bytes], rank: int, step: int) -> Iterator[memoryview | bytes]:
    for chunk in chunks:
        yield chunk
        raise OSError(f"debug.fail_save_rank: rank {rank} fails while writing its part of step {step}")
