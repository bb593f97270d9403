"""The local checkpoint tier: frequent checkpoints on node-local disk or tmpfs, for fast recovery.

A crash loses the steps since the last checkpoint; checkpoints to the run dir (S3, a shared file
system) are too slow to take every few steps. `[checkpoint.local]` adds a second tier with its own
cadence, `every_steps`, in a local folder: `DIR/<run id>/rank-NNNNN/` is an ordinary
`CheckpointStore` (the same files, the same atomic commit and BLAKE3 manifest, retention keeping
`keep`), written by each training process itself at the steps where no persistent save is due, as
the persistent tier saves (`save_like`): with `checkpoint.async_save`, in the background through
the persistent saver's own staging memory (one staging memory per rank for both tiers: a
persistent save begins once the local save before it has written its bytes; a local save due while
a persistent one is still writing, to S3 perhaps, is written in the step loop instead of waiting),
else in the step loop. A tmpfs folder (`/dev/shm`) makes it a RAM tier: no other code.

Several ranks (DDP, FSDP). Each rank keeps a whole checkpoint of its own in its own folder (the
replicated parts, its per-rank parts, its rank and the world size in state.json; under FSDP its
shards of the sharded parts, written through DCP as by the run dir's checkpoints but with this
rank as its own coordinator: `shards-NNNNN.safetensors` and a `dcp-metadata.json` listing its
chunks alone, checkpoint/dcp.py): what it needs to resume without any other rank's files, so a
node-local disk per node is enough. At a resume the ranks agree, with one all-gather of the copies
each can verify, on the newest step the surviving copies can rebuild for the resuming world, at
its world size or another (checkpoint/save/local_recovery.py).

Trust. The run dir stays the source of truth; a local checkpoint is used only when it is newer,
belongs to this run and verifies byte for byte (run/resume.py). Keying the folder by the run id
keeps another run's files out of sight, and every local checkpoint also records the run id in its
meta (`RUN_ID_KEY`, inside state.json, which the manifest hashes), so a copy of another run's
checkpoint put in this run's folder is rejected too (`not_mine`).

Timeline. After a resume or a rollback (harness/run/rollback.py) to step S, local checkpoints
past S belong to an abandoned future (a resume from an older tier, `--resume URL`, the steps
before an anomaly) and are deleted before training goes on (`drop_after`), as local-first staging
does (checkpoint/save/local_first.py). A node absent at that resume keeps its copies past S; they
come back with it. So every local checkpoint records which start of training wrote it (`START_KEY`,
the index into run.json's `starts`, harness/records/run_files.py: the step each start resumed
from), and a copy of step T written by start j is rejected when a later start resumed from a step
before T (`abandoned`): resuming from it would undo that resume, and with it any config change
made there.

Peer copies. With several ranks each local save is also sent to a rank on another node, which
keeps it in its own local folder (checkpoint/save/peer_copies.py), so a node that is gone with its
disk loses nothing that a peer holds (recovery: checkpoint/save/local_recovery.py). The
exchange runs in the background, started once the local save is committed; this tier waits for
the local save and the exchange in flight before its next save, a `drop_after` and at the end of
the run (`finish`), so no local checkpoint or peer copy is deleted while it is being sent or
received.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import replace
from typing import Any

from harness.checkpoint.format import WORLD_SIZE_KEY
from harness.checkpoint.save.async_saver import AsyncSaver
from harness.checkpoint.save.commit import Committed, Committer
from harness.checkpoint.save.node_folders import folders, local_store
from harness.checkpoint.save.peer_copies import PeerCopies, peer_jump
from harness.checkpoint.save.saver import Saver, SaverArgs, Submitted
from harness.config import LocalTierSection
from harness.parallel import distributed
from harness.records.run_id import RUN_ID_KEY

PERSISTENT = "persistent"
START_KEY = "start"  # meta: which start of the run wrote the checkpoint (an index into run.json's `starts`)


def not_mine(state: Mapping[str, Any], run_id: str, owner: int) -> str | None:
    """Why a local checkpoint whose state.json is `state`, found in the folder of rank `owner`
    (its own, or a peer copy of it), is not a copy of that rank's checkpoint in the run `run_id`
    (None when it is): another run's, or another rank's. Which ranks of which world size it
    can serve is coverage's question (checkpoint/save/coverage.py)."""
    meta = state["meta"]
    if meta.get(RUN_ID_KEY) != run_id:
        return f"it was written by run {meta.get(RUN_ID_KEY)}, not by this run {run_id}"
    if state.get("rank") != owner:
        return f"it holds rank {state.get('rank')}'s state, in the folder of rank {owner}"
    return None


def abandoned(meta: Mapping[str, Any], step: int, starts: Sequence[int]) -> str | None:
    """Why the local checkpoint of `step` whose meta is `meta` lies on a future the run abandoned
    (None when it does not): a start of training after the one that wrote it resumed from an
    earlier step. `starts`: the step each start of the run resumed from, in order (run.json's). A
    checkpoint that records no start predates the record and is judged by the rest alone."""
    start = meta.get(START_KEY)
    if start is None:
        return None
    if start >= len(starts):
        return f"it was written by start {start} of the run, which the run dir's run.json does not record"
    for later in range(start + 1, len(starts)):
        if starts[later] < step:
            return (f"it lies on an abandoned future: start {later} of the run resumed from step {starts[later]}, "
                    f"before this copy's step {step} (written by start {start}; its node missed that resume)")
    return None


class LocalTier:
    """Saves the live state into the local tier of run `run_id` (when: the loop's clock for this tier).

    `resumed_step`: the step the state was restored from (0 when fresh); the copies past it in every
    folder of the run on this node are deleted now (module docstring). `per_rank`, `sharded`: as
    `Saver`'s. With peer copies (`peer_jump`) every rank makes it at the same point;
    `peer_delay_s`: `PeerCopies`' `delay_s`; `start`: which start of the run this process is (run.json's
    `starts`), recorded in every checkpoint's meta (None: not recorded). It saves in the caller's
    thread until `save_like` says otherwise."""

    def __init__(self, section: LocalTierSection, run_id: str, resumed_step: int,
                 per_rank: Collection[str] = (), sharded: Collection[str] = (), peer_delay_s: float = 0.0,
                 start: int | None = None) -> None:
        self.section, self.run_id, self.start = section, run_id, start
        self.per_rank, self.sharded = per_rank, sharded
        self.store = local_store(section, run_id, distributed.rank())
        jump = peer_jump(section, distributed.world())
        self.peers = PeerCopies(section, run_id, jump, peer_delay_s) if jump else None
        self.on_commit: Callable[[Committed], None] | None = None
        self.saver: Saver = self._saver(None)
        self.in_thread = self.saver  # for a save due while the run dir's persist holds the staging memory
        self.persistent: AsyncSaver | None = None
        self.drop_after(resumed_step)

    def _saver(self, persistent: Saver | None) -> Saver:
        common = SaverArgs(rank=distributed.rank(), per_rank=self.per_rank, sharded=self.sharded,
                           on_commit=self._committed)
        commit = Committer(self.store, own_shards=True)
        if isinstance(persistent, AsyncSaver):
            return AsyncSaver(commit, staging=persistent.staging, save_deadline_s=persistent.save_deadline_s,
                              slow_floor_s=persistent.slow_floor_s, **common)
        return Saver(commit, **common)

    def save_like(self, persistent: Saver, on_commit: Callable[[Committed], None] | None = None) -> None:
        """Save as `persistent` (the run dir's saver) does: in the background through its staging
        memory when it is an `AsyncSaver`, else in the caller's thread. `on_commit(Committed)`
        after each local commit (from the background thread when saving in the background)."""
        self.finish()
        self.saver, self.on_commit = self._saver(persistent), on_commit
        self.in_thread = self._saver(None)
        self.persistent = persistent if isinstance(persistent, AsyncSaver) else None

    @property
    def background(self) -> bool:
        """Whether a save returns before it is committed (`save_like` an `AsyncSaver`)."""
        return self.saver.background

    def _committed(self, done: Committed) -> None:
        if self.peers is not None:
            self.peers.start(self.store, done.ref.step)
        if self.on_commit is not None:
            self.on_commit(done)

    def prepare(self, parts: Mapping[str, Any]) -> None:
        """Make the saver's staging memory ready (`Saver.prepare`): the persistent saver's, shared."""
        self.saver.prepare(parts)

    def drop_after(self, step: int) -> None:
        """Delete the copies past `step` in every folder of the run on this node (its own, its peer
        copies, those it wrote or received under an earlier rank or jump): the live state went
        back to `step` (once the save and the exchange in flight are over: they may be writing or
        reading one of them). Ranks sharing the folder delete the same ones: what is gone already
        is no error (`CheckpointStore.delete`)."""
        self.finish()
        for folder in folders(self.section, self.run_id):
            for ref in folder.store.list():
                if ref.step > step:
                    folder.store.delete(ref)

    def save(self, step: int, parts: Mapping[str, Any], meta: Mapping[str, Any]) -> Submitted:
        """Save `parts` as `step` in this rank's local folder, its meta stamped with the run id, the
        world size and the start; returns when committed (retention applied), or in the
        background once the snapshot is taken. The local save and the exchange in flight are
        waited for first (`blocking_s` counts that wait); this step's exchange starts once it
        is committed, in the background (not counted)."""
        meta = {**meta, RUN_ID_KEY: self.run_id, WORLD_SIZE_KEY: distributed.world()}
        if self.start is not None:
            meta[START_KEY] = self.start
        t0 = time.perf_counter()
        self.finish()
        waited = time.perf_counter() - t0
        # A persist of the run dir's in flight holds the staging memory until its bytes are out (to
        # S3, perhaps): rather than wait for that, this save writes the node's disk in this thread.
        saver = self.in_thread if self.persistent is not None and self.persistent.busy else self.saver
        submitted = saver.save(step, parts, meta=meta, must=True)
        assert submitted is not None  # a save that must is never skipped
        return replace(submitted, blocking_s=submitted.blocking_s + waited, waited_s=submitted.waited_s + waited)

    def finish(self) -> None:
        """Wait for the local save in flight (raising its failure), then the peer exchange it started:
        at the end of a run, its last peer copy is committed when this returns (or the copies
        stopped, logged: `PeerCopies`)."""
        self.saver.finish()
        if self.peers is not None:
            self.peers.wait()

    def close(self) -> None:
        """On an error exit: let a good local save in flight end, then wait for the peer exchange
        in flight, within a bound (`PeerCopies.close`)."""
        self.saver.close()
        if self.peers is not None:
            self.peers.close()
