"""Recovery from the local tier: the newest step the surviving copies of all ranks can rebuild for
the world that resumes, at its world size or another (`LocalRecovery`).

Every copy on a node's disk is a candidate, whatever rank wrote it: what a copy can supply is its
coverage (coverage.py), not who wrote it, and a node whose rank changed (a world that shrank, or
grew again) keeps the copies it wrote or received under its earlier ranks. So each rank looks at
every folder of the run on its node (checkpoint/save/node_folders.py: the `rank-NNNNN` folders of
whatever ranks this node has been, the `peer-of-rank-NNNNN` folders of the copies others sent),
each copy written by this run and by the folder's owner (`not_mine`), on the run's timeline
(`abandoned`), every byte against its manifest. The ranks that share a node's folder (`disk_id`)
split that work, each copy verified by one of them, and each holds what all of them verified.
A copy that fails is skipped and reported (a `checkpoint_rejected` record: tier, owner, step,
url, problem). One all-gather tells every rank which copies each node holds (step, owner, world
size, timeline, mode: `coverage.Copy`), and `coverage.plan`, the same computation on every rank
from the same lists, picks the newest step every rank of this world can be served at and the
copy each rank loads: its own at this world size where one survives (bitwise the uninterrupted
run's state), else one its part can be derived from (DDP's replicated state with a global data
cursor, at another world size or in exact elastic mode; coverage.py), and for FSDP at another
rank or world size one copy per rank that wrote the shards. A rank whose node lacks a copy it
needs receives it from a rank holding it (point to point on the peer group), once per node:
committed in the owner's own folder where the owner is a rank of this world on this node, else
in the owner's peer folder, where its node's other ranks read it too; from there `Resume`
(run/resume.py) verifies it again before loading it. If a copy arrives damaged no rank resumes
from the local tier (all or none: ranks never load different steps) and the persistent tier is
the fallback, as when no step is covered; the steps passed over for want of coverage are
reported with their reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from harness.checkpoint.discovery import CheckpointRef, skipped
from harness.checkpoint.errors import CheckpointCorrupt
from harness.checkpoint.format import WORLD_SIZE_KEY
from harness.checkpoint.loading import Checkpoint
from harness.checkpoint.save.coverage import Copy, Coverage, Plan, plan
from harness.checkpoint.save.local_tier import abandoned, not_mine
from harness.checkpoint.save.node_folders import LOCAL, PEER, Folder, disk_id, folder, folders, local_store, peer_store
from harness.checkpoint.save.peer_copies import Incoming, Outgoing, peer_group, transfer
from harness.checkpoint.store import CheckpointStore
from harness.config import LocalTierSection
from harness.log import get_logger
from harness.parallel import distributed

log = get_logger(__name__)


def copy_of(checkpoint: Checkpoint, owner: int) -> Copy:
    """What the verified local checkpoint `checkpoint` of rank `owner` can supply (coverage.py)."""
    state = checkpoint.state
    meta = state["meta"]
    return Copy(step=checkpoint.ref.step, owner=owner, world=int(meta.get(WORLD_SIZE_KEY, 1)),
                timeline=str(state["parts"].get("trainer", {}).get("loss_digest", "")),
                exact=meta.get("config", {}).get("parallel", {}).get("exact_elastic") is True,
                sharded=checkpoint.sharded)


@dataclass(frozen=True)
class Chosen:
    """The local checkpoint this rank loads: `ref` in `store`, written by rank `owner`; `tier`:
    LOCAL when every rank loads a copy of its own rank's that its node holds, else PEER; `shards`: the stores
    (own and peer folders) holding the copies of the same step whose shards it reads (empty: its
    own copy's, or nothing sharded) with each copy's owner."""

    store: CheckpointStore
    ref: CheckpointRef
    owner: int
    tier: str
    shards: tuple[tuple[CheckpointStore, int], ...] = ()


@dataclass
class LocalRecovery:
    """This rank's node's local tier of the run `run_id` as a source to resume from; `starts`: the
    step each start of the run so far resumed from (run.json's, local_tier.abandoned). `rejected`
    collects one record per copy passed over (from every rank, with its `rank`) and per newer
    step the copies do not cover."""

    section: LocalTierSection
    run_id: str
    starts: tuple[int, ...] = ()
    rejected: list[dict[str, Any]] = field(default_factory=list)
    _verified: set[tuple[str, int]] = field(default_factory=set)

    @property
    def own(self) -> CheckpointStore:
        return local_store(self.section, self.run_id, distributed.rank())

    def problem(self, store: CheckpointStore, ref: CheckpointRef, state: dict[str, Any], owner: int) -> str | None:
        """Why the copy `ref` of rank `owner` in `store` (its state.json `state` already read) must
        not be loaded (`not_mine`, `abandoned`), else the first file that does not match its manifest (reads
        every byte, once per copy). None when good."""
        other = not_mine(state, self.run_id, owner) or abandoned(state["meta"], ref.step, self.starts)
        if other:
            return other
        if (store.url, ref.step) not in self._verified:
            problems = store.verify(ref)
            if problems:
                return problems[0]
            self._verified.add((store.url, ref.step))
        return None

    def held(self, share: tuple[int, int] = (0, 1)) -> tuple[list[tuple[Copy, Folder]], list[dict[str, Any]]]:
        """(every good copy on this node with its folder, one record per copy passed over), of
        the copies in every folder of the run here; `share` = (i, n): the i-th of every n of
        them only (n ranks share this node's folder)."""
        held, rejected = [], []
        index, count = share
        listed = [(f, ref) for f in folders(self.section, self.run_id) for ref in f.store.candidates()]
        for where, ref in listed[index::count]:
            try:
                checkpoint = where.store.open(ref)
                problem = self.problem(where.store, ref, checkpoint.state, where.owner)
            except CheckpointCorrupt as e:
                problem = str(e)
            if problem:
                skipped(ref, [problem])
                rejected.append({"tier": where.tier, "owner": where.owner, "step": ref.step, "url": ref.url,
                                 "problem": problem[:300]})
            else:
                held.append((copy_of(checkpoint, where.owner), where))
        return held, rejected

    def choose(self, coverage: Coverage) -> Chosen | None:
        """The local checkpoint this rank loads, agreed by every rank (collective: every rank calls
        it at the same point), with the copies some ranks lack moved to them first; None when the
        local tier has no step every rank can be served at (module docstring). `coverage`: what
        this run can take from a copy another rank or world size wrote."""
        me = distributed.rank()
        disks = distributed.all_gather_object(disk_id(self.section, self.run_id))
        mates = [rank for rank, disk in enumerate(disks) if disk == disks[me]]
        held, rejected = self.held((mates.index(me), len(mates)))
        gathered = distributed.all_gather_object(([(c, f.name) for c, f in held], rejected))
        self.rejected = [{**r, "rank": rank} for rank, (_, records) in enumerate(gathered) for r in records]
        on_disk: dict[str, dict[Copy, str]] = {}  # disk -> every copy its ranks verified -> its folder
        for rank, (copies, _) in enumerate(gathered):
            for copy, name in copies:
                on_disk.setdefault(disks[rank], {}).setdefault(copy, name)
        here = on_disk.get(disks[me], {})
        # What a rank of this node verified, the others hold too: the same bytes, not read again.
        stores = {copy: self._folder(name).store for copy, name in here.items()}
        self._verified |= {(store.url, copy.step) for copy, store in stores.items()}
        chosen = plan([list(on_disk.get(disk, {})) for disk in disks], coverage)
        # A step passed over for a copy rejected above has its reason there already.
        explained = {r["step"] for r in self.rejected}
        self.rejected += [{"tier": LOCAL, "step": step, "url": self.own.url, "problem": why}
                          for step, why in chosen.passed if step not in explained]
        if chosen.step is None:
            return None
        at = self._move(chosen, stores, disks)
        if not distributed.all_ok(at is not None):
            return None
        assert at is not None  # else all_ok was false on every rank
        source = chosen.sources[me]
        tier = PEER if chosen.from_peer else LOCAL
        if chosen.moves or source.copy.world != distributed.world():
            log.info("local checkpoint assembled from the surviving copies", step=chosen.step, tier=tier,
                     saved_world=chosen.saved_world, world=distributed.world(),
                     shard_copies=len(chosen.shards[me]),
                     moved=[{"to": rank, "holder": s.holder, "owner": s.copy.owner} for rank, s in chosen.moves])
        store = at[source.copy]
        return Chosen(store, store.ref(chosen.step), source.copy.owner, tier,
                      tuple((at[s.copy], s.copy.owner) for s in chosen.shards[me]))

    def _folder(self, name: str) -> Folder:
        found = folder(self.section, self.run_id, name)
        assert found is not None  # a name `folders` gave
        return found

    def _move(self, chosen: Plan, stores: dict[Copy, CheckpointStore], disks: list[str]
              ) -> dict[Copy, CheckpointStore] | None:
        """Send and receive the copies `chosen` moves, in the same order on every rank (each pair
        meets in turn), each once per node (`disks[rank]`: the node's folder of each rank): the
        first of a node's ranks to need it receives it, where its other ranks find it too
        (`_arrival`). Where this rank then finds each copy it loads from, or None when one
        arrived damaged."""
        me = distributed.rank()
        step = chosen.step
        assert step is not None  # `choose` moves the copies of a step it chose
        at = dict(stores)
        if chosen.moves:
            peer_group()  # collective: made here by every rank, also those no copy moves to or from
        delivered = set()
        for rank, source in chosen.moves:
            if (disks[rank], source.copy) in delivered:
                continue  # in the folder of `rank`'s node already
            delivered.add((disks[rank], source.copy))
            if disks[rank] == disks[me]:
                at[source.copy] = target = self._arrival(source.copy.owner, disks)
                self._verified.discard((target.url, step))  # what arrives is read again before loading
            if me == source.holder:
                store = stores[source.copy]
                transfer(Outgoing(rank, store, store.ref(step)), None)
            elif me == rank:
                try:
                    transfer(None, Incoming(source.holder, at[source.copy]))
                except CheckpointCorrupt as e:
                    log.warning("the copy arrived damaged; not resuming from the local tier", step=chosen.step,
                                holder=source.holder, owner=source.copy.owner, problem=str(e)[:300])
                    return None
        return at

    def _arrival(self, owner: int, disks: list[str]) -> CheckpointStore:
        """Where a copy of rank `owner`'s sent to this node is committed: the owner's own folder when
        rank `owner` of this world is on this node (the copy stands in for its own), else the
        owner's peer folder."""
        if owner < len(disks) and disks[owner] == disks[distributed.rank()]:
            return local_store(self.section, self.run_id, owner)
        return peer_store(self.section, self.run_id, owner)
