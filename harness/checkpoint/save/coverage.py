"""Which surviving local-tier copies can rebuild a step for the ranks of a new world (`plan`).

A copy (`Copy`) is one rank's local checkpoint of one step, verified by the rank that holds it
(in the owner's own folder or as a peer copy). What it can supply is its coverage, not who
wrote it:
- its replicated parts (model and optimizer of one process or DDP, schedulers, counters) are
  whole in every copy;
- its per-rank parts are its owner's: the data cursor counts global samples (a map-style
  dataset: it serves every rank at any world size, harness/data/order.py), and the random
  streams either are the same on every rank (exact elastic mode: training draws only from
  per-micro-batch streams, every rank keeps the run seed's) or are restarted anyway (a resume at
  another world size outside that mode, harness/run/elastic.py). A user's iterator state
  belongs to the rank that saved it, and outside exact mode so do a rank's streams at the same
  world size: such a copy serves its owner alone;
- sharded parts (FSDP) are the owner's shards alone: its owner at the same world size reads
  them from its own copy; any other rank, or a world of another size, reads its share from the
  union of one copy per rank of the world that wrote them (resharded by DCP's planner), which
  every such rank then needs.
`Coverage.serves` is the rule for the unsharded state, `plan` finds the shards. A loss digest
(every loss so far, chained) names each copy's timeline: copies of one step that disagree on it
come from different histories (a node that missed a resume kept its abandoned future) and are
never combined.

`plan(held, coverage)` is computed by every rank from the same gathered holdings and gives the
same answer everywhere: the newest step whose every rank of the new world is served by some
held copy, each rank's source preferring its own copy at this world size (the state of the
uninterrupted run, random streams included), then a copy it holds itself, then one written at
this world size, then its own folder's, then the lowest holder (for shards: the rank itself,
then the lowest holder). Steps newer than the chosen one
are listed with the reason they were passed. No torch here: the plan is pure data.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Copy:
    """One rank's local checkpoint of `step` as some rank holds it: `owner` wrote it at world size
    `world`; `timeline` is its loss digest; `exact`: trained in exact elastic mode; `sharded`:
    it holds FSDP shards."""

    step: int
    owner: int
    world: int
    timeline: str
    exact: bool = False
    sharded: bool = False


@dataclass(frozen=True)
class Coverage:
    """What the resuming run can take from a copy it did not write at its own rank and world:
    `global_data`: its data cursor is a global sample count (map-style data, not a user's
    iterator)."""

    global_data: bool

    def why_not(self, copy: Copy, rank: int, world: int) -> str | None:
        """Why `copy` cannot supply the unsharded state of rank `rank` of a world of `world`
        (None: it can; its shards are `plan`'s to find)."""
        if copy.owner == rank and copy.world == world:
            return None
        if not self.global_data:
            return "a data.factory iterator's state serves the rank that saved it only"
        if not copy.exact and copy.world == world:
            return "outside exact elastic mode a rank's random streams are its own at the same world size"
        return None

    def serves(self, copy: Copy, rank: int, world: int) -> bool:
        return self.why_not(copy, rank, world) is None


@dataclass(frozen=True)
class Source:
    """Where one copy comes from: `copy`, held by rank `holder`."""

    holder: int
    copy: Copy


@dataclass(frozen=True)
class Plan:
    """The step every rank resumes from (None: the local tier has none), `sources[rank]` for each
    rank (the copy whose state.json and unsharded tensors it loads), `shards[rank]` the copies
    whose shards it reads its sharded parts from (empty: its source's own, or nothing sharded),
    and (step, reason) for every newer step passed over."""

    step: int | None
    sources: tuple[Source, ...] = ()
    shards: tuple[tuple[Source, ...], ...] = ()
    passed: tuple[tuple[int, str], ...] = ()

    @property
    def moves(self) -> list[tuple[int, Source]]:
        """(receiving rank, source) for each copy a rank needs and another rank holds, in rank
        order, each once."""
        out = []
        for rank, source in enumerate(self.sources):
            needed = [source, *self.shards[rank]]
            out += [(rank, s) for i, s in enumerate(needed) if s.holder != rank and s.copy not in
                    [n.copy for n in needed[:i]]]
        return out

    @property
    def from_peer(self) -> bool:
        """Whether some rank's state is not (only) its own copy in its own folder."""
        return any(s.holder != rank or s.copy.owner != rank or self.shards[rank] for rank, s in enumerate(self.sources))

    @property
    def saved_world(self) -> int | None:
        return self.sources[0].copy.world if self.sources else None


def _preference(rank: int, world: int, holder: int, copy: Copy) -> tuple[bool, bool, bool, bool, int, int]:
    return (not (copy.owner == rank and copy.world == world), holder != rank, copy.world != world, copy.owner != rank,
            holder, copy.owner)


def _shard_set(at: Sequence[tuple[int, Copy]], written: int, rank: int) -> tuple[Source, ...] | str:
    """One held copy per rank of the world of `written` ranks that wrote the sharded state, the
    ones `rank` holds first; else why there is none."""
    sources, lost = [], []
    for owner in range(written):
        options = [(h, c) for h, c in at if c.owner == owner and c.world == written and c.sharded]
        if options:
            sources.append(Source(*min(options, key=lambda hc: (hc[0] != rank, hc[0]))))
        else:
            lost.append(owner)
    if lost:
        return (f"the FSDP shards of rank(s) {', '.join(map(str, lost))} of {written} survive in no copy (the "
                f"persistent tier reshards)")
    return tuple(sources)


def _serve(at: Sequence[tuple[int, Copy]], coverage: Coverage, rank: int, world: int
           ) -> tuple[Source, tuple[Source, ...]] | list[str]:
    """(source, shard sources) for `rank`, by preference; else every reason none serves."""
    options = sorted(((h, c) for h, c in at if coverage.serves(c, rank, world)),
                     key=lambda hc: _preference(rank, world, *hc))
    reasons = sorted({why for _, c in at if (why := coverage.why_not(c, rank, world))})
    for holder, copy in options:
        if not copy.sharded or (copy.owner == rank and copy.world == world):
            return Source(holder, copy), ()
        shards = _shard_set(at, copy.world, rank)
        if not isinstance(shards, str):
            return Source(holder, copy), shards
        reasons.append(shards)
    return sorted(set(reasons))


def plan(held: Sequence[Sequence[Copy]], coverage: Coverage) -> Plan:
    """The recovery of a world of `len(held)` ranks, `held[r]` being rank r's verified copies
    (module docstring). The same on every rank for the same `held`."""
    world = len(held)
    passed: list[tuple[int, str]] = []
    for step in sorted({c.step for copies in held for c in copies}, reverse=True):
        at = [(holder, c) for holder, copies in enumerate(held) for c in copies if c.step == step]
        if len({c.timeline for _, c in at}) > 1:
            passed.append((step, f"the copies of step {step} disagree on the losses before it (one of them is of an "
                                 f"abandoned history)"))
            continue
        served = [_serve(at, coverage, rank, world) for rank in range(world)]
        missing = next((rank for rank, s in enumerate(served) if isinstance(s, list)), None)
        if missing is None:
            sources = [s for s in served if not isinstance(s, list)]  # all of them
            return Plan(step, tuple(s[0] for s in sources), tuple(s[1] for s in sources), tuple(passed))
        reasons = served[missing]
        assert isinstance(reasons, list)  # the first rank none serves
        owners = sorted({(c.owner, c.world) for _, c in at})
        passed.append((step, f"no surviving copies of step {step} serve rank {missing} of {world} (held: "
                             f"{', '.join(f'rank {o} of {w}' for o, w in owners)}): {'; '.join(reasons)}"))
    return Plan(None, passed=tuple(passed))
