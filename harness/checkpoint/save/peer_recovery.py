"""Recovery from the local tier with peer copies (checkpoint/save/peer_copies.py): the newest step
whose every rank's part is held, verified, by some rank.

Each rank verifies what it holds: its own local checkpoints (`LocalSource`, run/resume.py) and
its peer copies (`PeerHoldings.verified`: written by this run, by the owner rank, at this world
size, every byte against the manifest; a copy that fails is skipped and reported, tier "peer").
One all-gather tells every rank who holds which (owner rank, step), and `assemble`, the same
computation on every rank from the same lists, picks the newest step S at which every owner's
part is held somewhere. A rank whose own copy at S is missing or damaged receives it from the
lowest rank holding a copy and commits it in its own local folder; from there it is what a rank
with its own copy has, and `resume_newest` verifies it again before loading it as its own. If a
copy arrives damaged, no rank resumes from the local tier (all or none: ranks never load
different steps) and the persistent tier is the fallback, as when no step is whole.
"""

from __future__ import annotations

from typing import Any

from harness.checkpoint.discovery import skipped
from harness.checkpoint.errors import CheckpointCorrupt
from harness.checkpoint.save.local_tier import LOCAL, not_mine
from harness.checkpoint.save.peer_copies import PEER, Incoming, Outgoing, peer_group, peer_stores, transfer
from harness.checkpoint.store import CheckpointStore
from harness.config import LocalTierSection
from harness.log import get_logger
from harness.parallel import distributed

log = get_logger(__name__)


class PeerHoldings:
    """The peer copies of the run `run_id` in this node's local folder, as a source to resume from."""

    def __init__(self, section: LocalTierSection, run_id: str) -> None:
        self.stores = peer_stores(section, run_id)
        self.run_id = run_id

    def verified(self) -> tuple[list[tuple[int, int]], list[dict[str, Any]]]:
        """((owner rank, step) of every peer copy held here that may stand in for its owner's own,
        one record (tier, owner, step, url, problem) per copy passed over). Reads every byte."""
        held, rejected = [], []
        for owner, store in sorted(self.stores.items()):
            for ref in store.candidates():
                try:
                    other = not_mine(store.open(ref).state, self.run_id, owner, distributed.world())
                    problems = [other] if other else store.verify(ref)
                except CheckpointCorrupt as e:
                    problems = [str(e)]
                if problems:
                    skipped(ref, problems)
                    rejected.append({"tier": PEER, "owner": owner, "step": ref.step, "url": ref.url,
                                     "problem": problems[0][:300]})
                else:
                    held.append((owner, ref.step))
        return held, rejected

    def assemble(self, own: CheckpointStore, gathered: list[tuple[list[int], list[tuple[int, int]]]]
                 ) -> tuple[int | None, str]:
        """(the step every rank resumes from the local tier, None for none; the tier to report:
        `PEER` when a rank's part came from a peer copy, else `LOCAL`), with the missing parts
        moved into their owners' folders (`own` is this rank's). `gathered`: every rank's (steps of
        its own verified local checkpoints, its `verified` peer copies), in rank order.
        Collective: every rank calls it with the same `gathered`."""
        holders: dict[tuple[int, int], list[int]] = {}
        for rank, (steps, held) in enumerate(gathered):
            for part in [(rank, step) for step in steps] + held:
                holders.setdefault(part, []).append(rank)
        world = len(gathered)
        whole = [step for _, step in holders if all((owner, step) in holders for owner in range(world))]
        if not whole:
            return None, LOCAL
        step = max(whole)
        moves = [(owner, min(holders[owner, step])) for owner in range(world) if step not in gathered[owner][0]]
        peer_group()  # collective: made here by every rank, also those no copy moves to or from
        arrived = True
        for owner, holder in moves:  # in the same order on every rank: each pair meets in turn
            if distributed.rank() == holder:
                store = self.stores[owner]
                transfer(Outgoing(owner, store, store.ref(step)), None)
            elif distributed.rank() == owner:
                try:
                    transfer(None, Incoming(holder, own))
                except CheckpointCorrupt as e:
                    log.warning("the peer copy arrived damaged; not resuming from the local tier", step=step,
                                holder=holder, problem=str(e)[:300])
                    arrived = False
        if moves:
            log.info("local checkpoint assembled from peer copies", step=step,
                     moved=[{"owner": owner, "holder": holder} for owner, holder in moves])
        if not distributed.all_ok(arrived):
            return None, LOCAL
        return step, PEER if moves else LOCAL
