"""One checkpoint written by every rank of a process group, and loaded back by every rank.

The trade-off first: every rank writes only what is its own, and one process (rank 0) decides
whether the checkpoint exists. Replicated state (model, optimizer, schedulers, counters) is
identical on every rank under DDP, so rank 0 alone writes it; per-rank state (RNG streams; the
data cursor, which is global and the same everywhere but cheap) is written by each rank; the
manifest is the commit point, written last and by rank 0 only, so a failure of any rank at any
moment before it leaves no checkpoint at all, and the previous one stays the newest good one.

Commit (`GroupCommit`; every rank calls it at the same step, the step loop agrees on that):
1. rank 0 begins (`store.begin`: a fresh temporary folder on local disk, the step folder on an
   object store) and broadcasts the folder; a failure there is raised on every rank.
2. each rank writes its files into that folder: rank 0 exactly what a single process writes
   (`<part>.safetensors`, `rank-00000.safetensors`, `state.json` with rank 0's per-rank trees);
   rank r > 0 `rank-NNNNN.safetensors` (the tensors of its per-rank parts) and `rank-NNNNN.json`
   (their JSON side, in the layout of state.json).
3. the ranks gather each rank's outcome: its file records (size, digest), or its error.
4. rank 0 seals (manifest listing every rank's files, fsync, rename; then retention) only if
   every rank succeeded; otherwise it discards the folder. It broadcasts the result, and every
   rank returns the same ref or raises. A killed rank makes the others fail in the next
   collective, before any manifest exists.
Saving in the background (`AsyncSaver(store, commit=GroupCommit(store, group=side), select=
GroupCommit.mine)`): each rank stages only what it writes (`mine`: everything on rank 0, its own
rank file on the others) and runs this same commit in its persist thread, with every collective
on `group`, a second gloo group (`distributed.new_side_group`). The main group stays the step
loop's alone, so a commit in flight never interleaves with a training all-reduce; the ranks'
persists run in the same order on every rank (the step loop agrees on every save, and on
skipping one), so the side group's collectives match up.

Load (`load_checkpoint`): rank 0 decides which checkpoint (harness/run/resume.py), every rank reads the
replicated parts and its own per-rank parts. A rank that did not exist in the saving run takes
rank 0's data cursor (the position counts samples of all ranks together, so it re-splits for any
world size with no sample repeated or skipped) and keeps its freshly seeded RNG. A different
world size is allowed with a warning: bitwise equality is promised only for the same world size.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any

from harness import distributed
from harness.checkpoint.format import RANK_PARTS, STATE_FILE, Snapshot, dump_state, tensor_file
from harness.checkpoint.manifest import FileRecord
from harness.checkpoint.store import CheckpointRef, CheckpointStore, Verify
from harness.checkpoint.tensorfile import serialize
from harness.log import get_logger

log = get_logger(__name__)

WORLD_SIZE_KEY = "world_size"


class CommitAborted(RuntimeError):
    """Another rank failed to write its part of a checkpoint; nothing was committed."""


def rank_state_file(rank: int) -> str:
    return f"rank-{rank:05d}.json"


class GroupCommit:
    """`commit(step, snapshot, meta=)` for the process group (or the plain store commit without one).

    `group`: the process group of the commit's collectives (default: the main one; a side group
    when it runs in a background thread). `fail_rank`, `fail_step`: the test hook
    `debug.fail_save_rank` / `debug.fail_save_step`: that rank fails half-way through writing its
    tensor file (at every save, or only at `fail_step`).
    """

    def __init__(self, store: CheckpointStore, *, group: Any = None, fail_rank: int | None = None,
                 fail_step: int | None = None) -> None:
        self.store, self.group = store, group
        self.fail_rank, self.fail_step = fail_rank, fail_step

    @staticmethod
    def mine(snapshot: Snapshot) -> Snapshot:
        """The part of `snapshot` its rank writes: all of it on rank 0; on rank r > 0 its own
        rank file and per-rank trees (what `_write_own` reads), so a background save stages no
        copy of the replicated state there."""
        if snapshot.rank == 0:
            return snapshot
        own = tensor_file(min(RANK_PARTS), snapshot.rank)
        tensors = {f: t for f, t in snapshot.tensors.items() if f == own}
        return replace(snapshot, tensors=tensors, parts={p: t for p, t in snapshot.parts.items() if p in RANK_PARTS},
                       nbytes=sum(t.numel() * t.element_size() for named in tensors.values() for t in named.values()))

    def __call__(self, step: int, snapshot: Snapshot, *, meta: Mapping[str, Any] | None = None) -> CheckpointRef:
        if not distributed.is_distributed():
            return self.store.commit(step, snapshot, meta=meta)
        rank, group = distributed.rank(), self.group
        ref, work = distributed.on_rank0(self.store.begin, step, group=group)
        try:
            records = self._write_own(ref, work, snapshot, {**(meta or {}), WORLD_SIZE_KEY: distributed.world()})
            mine: tuple[bool, Any] = (True, records)
        except Exception as e:  # noqa: BLE001 - reported to rank 0, then re-raised below
            mine, failure = (False, f"{type(e).__name__}: {e}"), e
        outcomes = distributed.all_gather_object(mine, group=group)
        failed = [(r, err) for r, (ok, err) in enumerate(outcomes) if not ok]
        if failed:
            if rank == 0:
                self.store.discard(work)
            distributed.barrier(group)  # the folder is gone before anyone reports
            if not mine[0]:
                raise failure
            r, err = failed[0]
            raise CommitAborted(f"rank {r} failed to write its part of the checkpoint at step {step} ({err}); nothing "
                                f"was committed, the previous checkpoint is still the newest good one")
        all_records = [rec for _, recs in outcomes for rec in recs]
        distributed.on_rank0(self._seal, ref, work, all_records, group=group)
        return ref

    def _write_own(self, ref: CheckpointRef, work: str, snapshot: Snapshot, meta: dict[str, Any]) -> list[FileRecord]:
        rank = snapshot.rank
        own = tensor_file(min(RANK_PARTS), rank)  # every per-rank part of a rank shares its file
        if rank == 0:
            files = sorted(snapshot.tensors.items())
        else:
            files = [(own, snapshot.tensors[own])] if own in snapshot.tensors else []
        records = []
        for file, tensors in files:
            chunks: Iterable = serialize(tensors, f"{ref.url}/{file}")
            if file == own and self._failing(rank, ref.step):
                chunks = _fail_after_first(chunks, rank, ref.step)
            records.append(self.store.write_file(work, ref, file, chunks))
        if rank == 0:
            records.append(self.store.write_file(work, ref, STATE_FILE, [dump_state(ref.step, snapshot, meta)]))
        else:
            per_rank = replace(snapshot, parts={p: t for p, t in snapshot.parts.items() if p in RANK_PARTS})
            records.append(self.store.write_file(work, ref, rank_state_file(rank), [dump_state(ref.step, per_rank, None)]))
        return records

    def _seal(self, ref: CheckpointRef, work: str, records: list[FileRecord]) -> None:
        try:
            manifest = self.store.seal(ref, work, records)
        except BaseException:
            self.store.discard(work)
            raise
        log.info("checkpoint committed", step=ref.step, url=ref.url, bytes=manifest.nbytes,
                 ranks=distributed.world())
        self.store.gc(newest_good=ref.step)

    def _failing(self, rank: int, step: int) -> bool:
        return self.fail_rank == rank and self.fail_step in (None, step)


def _fail_after_first(chunks: Iterable, rank: int, step: int):
    for chunk in chunks:
        yield chunk
        raise OSError(f"debug.fail_save_rank: rank {rank} fails while writing its part of step {step}")


def load_checkpoint(store: CheckpointStore, ref: CheckpointRef, targets: Mapping[str, Any],
                    verify: Verify = "no") -> dict[str, Any]:
    """Restore `targets` from `ref` on this rank (see the module docstring); returns the saved meta.
    `verify` as in `CheckpointStore.load`."""
    doc = store.read_state(ref)
    saved_world = int(doc["meta"].get(WORLD_SIZE_KEY, 1))
    rank, world = distributed.rank(), distributed.world()
    if saved_world != world and rank == 0:
        log.warning("resuming with a different world size: the data cursor is re-split (no sample of the epoch is "
                    "repeated or skipped), but bitwise equality with an uninterrupted run is not promised across "
                    "world sizes", saved_world_size=saved_world, world_size=world, step=ref.step)
    skip: tuple[str, ...] = ()
    if 0 < rank < saved_world:
        doc["parts"].update(store.read_state(ref, rank_state_file(rank))["parts"])
    elif rank >= saved_world:
        skip = ("rng",)  # a new rank keeps its own freshly seeded streams rather than copy rank 0's
    return store.load(ref, targets, skip=skip, state=doc, verify=verify)
