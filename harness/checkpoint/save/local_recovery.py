"""Recovery from the local tier: the newest step the surviving copies of all ranks can rebuild for
the world that resumes, at its world size or another (`LocalRecovery`).

Each rank verifies what its node holds of this run: its own local checkpoints (its folder
`rank-NNNNN`) and the peer copies of others (`peer-of-rank-NNNNN`, checkpoint/save/peer_copies.py),
each written by this run and by the folder's owner (`not_mine`), on the run's timeline (`abandoned`), every
byte against its manifest.
A copy that fails is skipped and reported (a `checkpoint_rejected` record: tier, step, url,
problem; `owner` for a peer copy). One all-gather tells every rank who holds what (step, owner,
world size, timeline, mode: `coverage.Copy`), and `coverage.plan`, the same computation on every
rank from the same lists, picks the newest step every rank of this world can be served at and
the copy each rank loads: its own at this world size where one survives (bitwise the
uninterrupted run's state), else one its part can be derived from (DDP's replicated state with
a global data cursor, at another world size or in exact elastic mode; coverage.py), and for FSDP
at another rank or world size one copy per rank that wrote the shards. A rank that needs a copy
another rank holds receives it from that rank (point to point on the peer group) and commits it
in its own local folder (its own part) or in the owner's peer folder (another rank's copy
standing in for it, or supplying its shards); from there `Resume` (run/resume.py) verifies it
again before loading it. If a copy arrives damaged no rank resumes from the local tier (all or
none: ranks never load different steps) and the persistent tier is the fallback, as when no
step is covered; the steps passed over for want of coverage are reported with their reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from harness.checkpoint.discovery import CheckpointRef, skipped
from harness.checkpoint.errors import CheckpointCorrupt
from harness.checkpoint.format import WORLD_SIZE_KEY
from harness.checkpoint.loading import Checkpoint
from harness.checkpoint.save.coverage import Copy, Coverage, Plan, plan
from harness.checkpoint.save.local_tier import LOCAL, abandoned, local_store, not_mine
from harness.checkpoint.save.peer_copies import PEER, Incoming, Outgoing, peer_group, peer_store, peer_stores, transfer
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
    LOCAL when every rank loads its own copy from its own folder, else PEER; `shards`: the stores
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

    def held(self) -> tuple[list[tuple[Copy, CheckpointStore]], list[dict[str, Any]]]:
        """(every good copy on this node with its store, one record per copy passed over)."""
        held, rejected = [], []
        me = distributed.rank()
        peers = sorted(peer_stores(self.section, self.run_id).items())
        folders = [(me, self.own, LOCAL), *[(owner, store, PEER) for owner, store in peers]]
        for owner, store, tier in folders:
            for ref in store.candidates():
                try:
                    checkpoint = store.open(ref)
                    problem = self.problem(store, ref, checkpoint.state, owner)
                except CheckpointCorrupt as e:
                    problem = str(e)
                if problem:
                    skipped(ref, [problem])
                    rejected.append({"tier": tier, **({"owner": owner} if tier == PEER else {}), "step": ref.step,
                                     "url": ref.url, "problem": problem[:300]})
                else:
                    held.append((copy_of(checkpoint, owner), store))
        return held, rejected

    def choose(self, coverage: Coverage) -> Chosen | None:
        """The local checkpoint this rank loads, agreed by every rank (collective: every rank calls
        it at the same point), with the copies some ranks lack moved to them first; None when the
        local tier has no step every rank can be served at (module docstring). `coverage`: what
        this run can take from a copy another rank or world size wrote."""
        held, rejected = self.held()
        gathered = distributed.all_gather_object(([c for c, _ in held], rejected))
        self.rejected = [{**r, "rank": rank} for rank, (_, records) in enumerate(gathered) for r in records]
        chosen = plan([copies for copies, _ in gathered], coverage)
        # A step passed over for a copy rejected above has its reason there already.
        explained = {r["step"] for r in self.rejected}
        self.rejected += [{"tier": LOCAL, "step": step, "url": self.own.url, "problem": why}
                          for step, why in chosen.passed if step not in explained]
        if chosen.step is None:
            return None
        at = self._move(chosen, dict(held))
        if not distributed.all_ok(at is not None):
            return None
        assert at is not None  # else all_ok was false on every rank
        me = distributed.rank()
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

    def _move(self, chosen: Plan, stores: dict[Copy, CheckpointStore]) -> dict[Copy, CheckpointStore] | None:
        """Send and receive the copies `chosen` moves, in the same order on every rank (each pair
        meets in turn); where this rank then holds each copy it loads from, or None when one
        arrived damaged."""
        me = distributed.rank()
        step = chosen.step
        assert step is not None  # `choose` moves the copies of a step it chose
        at = dict(stores)
        if chosen.moves:
            peer_group()  # collective: made here by every rank, also those no copy moves to or from
        for rank, source in chosen.moves:
            if me == source.holder:
                store = stores[source.copy]
                transfer(Outgoing(rank, store, store.ref(step)), None)
            elif me == rank:
                owner = source.copy.owner
                target = self.own if owner == me else peer_store(self.section, self.run_id, owner)
                try:
                    transfer(None, Incoming(source.holder, target))
                except CheckpointCorrupt as e:
                    log.warning("the copy arrived damaged; not resuming from the local tier", step=chosen.step,
                                holder=source.holder, owner=owner, problem=str(e)[:300])
                    return None
                at[source.copy] = target
        return at
