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
- sharded parts (FSDP) are the owner's shards alone: such a copy serves its owner at the same
  world size (resharding the union of copies is not built; the persistent tier reshards).
`Coverage.serves` is that rule. A loss digest (every loss so far, chained) names each copy's
timeline: copies of one step that disagree on it come from different histories (a node that
missed a resume kept its abandoned future) and are never combined.

`plan(held, coverage)` is computed by every rank from the same gathered holdings and gives the
same answer everywhere: the newest step whose every rank of the new world is served by some
held copy, each rank's source preferring its own copy at this world size (the state of the
uninterrupted run, random streams included), then a copy it holds itself, then one written at
this world size, then its own folder's, then the lowest holder. Steps newer than the chosen one
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
    iterator); `sharded`: this run shards its parts (FSDP at world size > 1)."""

    global_data: bool
    sharded: bool

    def why_not(self, copy: Copy, rank: int, world: int) -> str | None:
        """Why `copy` cannot supply rank `rank` of a world of `world` (None: it can)."""
        if copy.owner == rank and copy.world == world:
            return None
        if copy.sharded or self.sharded:
            return "FSDP shards serve their own rank at the same world size (the persistent tier reshards)"
        if not self.global_data:
            return "a data.factory iterator's state serves the rank that saved it only"
        if not copy.exact and copy.world == world:
            return "outside exact elastic mode a rank's random streams are its own at the same world size"
        return None

    def serves(self, copy: Copy, rank: int, world: int) -> bool:
        return self.why_not(copy, rank, world) is None


@dataclass(frozen=True)
class Source:
    """Where one rank's state comes from: `copy`, held by rank `holder`."""

    holder: int
    copy: Copy


@dataclass(frozen=True)
class Plan:
    """The step every rank resumes from (None: the local tier has none), `sources[rank]` for each
    rank, and (step, reason) for every newer step passed over."""

    step: int | None
    sources: tuple[Source, ...] = ()
    passed: tuple[tuple[int, str], ...] = ()

    @property
    def moves(self) -> list[tuple[int, Source]]:
        """(receiving rank, source) for each rank whose copy another rank holds, in rank order."""
        return [(rank, s) for rank, s in enumerate(self.sources) if s.holder != rank]

    @property
    def from_peer(self) -> bool:
        """Whether some rank's state is not its own copy in its own folder (a move or a peer copy)."""
        return any(s.holder != rank or s.copy.owner != rank for rank, s in enumerate(self.sources))

    @property
    def saved_world(self) -> int | None:
        return self.sources[0].copy.world if self.sources else None


def _preference(rank: int, world: int, holder: int, copy: Copy) -> tuple:
    return (not (copy.owner == rank and copy.world == world), holder != rank, copy.world != world, copy.owner != rank,
            holder, copy.owner)


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
        sources, missing = [], None
        for rank in range(world):
            options = [(h, c) for h, c in at if coverage.serves(c, rank, world)]
            if not options:
                missing = rank
                break
            holder, copy = min(options, key=lambda hc: _preference(rank, world, *hc))
            sources.append(Source(holder, copy))
        if missing is None:
            return Plan(step, tuple(sources), tuple(passed))
        owners = sorted({(c.owner, c.world) for _, c in at})
        reasons = sorted({why for _, c in at if (why := coverage.why_not(c, missing, world))})
        passed.append((step, f"no surviving copy of step {step} serves rank {missing} of {world} (held: "
                             f"{', '.join(f'rank {o} of {w}' for o, w in owners)}): {'; '.join(reasons)}"))
    return Plan(None, (), tuple(passed))
