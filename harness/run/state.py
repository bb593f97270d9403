"""The named set of everything a run must restore to continue bit for bit.

A part is anything with `state_dict()` / `load_state_dict()` (the `Stateful` protocol) whose
state dict is a tree of dicts, lists, tensors and JSON scalars (see docs/architecture.md); a part
may also offer `restore_template()`, its live tensors without the cost of its full state dict,
for loading to match against (checkpoint/into_live.py, `live_state`). Parts
are registered under stable names; the checkpoint stores each under its name, and loading
refuses a missing or unexpected part. The order of registration is the order of restoring,
and `rng` is restored last on purpose: building the other parts may draw random numbers.

A part registered `sharded` (FSDP: the model and optimizer hold DTensors) is written by every
rank, each its own shards, through torch.distributed.checkpoint (checkpoint/dcp.py).
Otherwise a part is replicated (every rank holds the same, rank 0 saves it) unless registered `per_rank`:
then each rank saves its own (`rank-NNNNN.*` files of the checkpoint). A per-rank part also
`kept_on_new_rank` is not taken from rank 0 by a rank the saving run did not have (its own
freshly seeded RNG streams rather than a copy of rank 0's); the others are (the data cursor).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable

from harness.health.anomaly import AnomalyLedger


@runtime_checkable
class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class TrainState:
    """Ordered name -> part registry. Names are the checkpoint's part names."""

    def __init__(self) -> None:
        self._parts: dict[str, Stateful] = {}
        self._per_rank: set[str] = set()
        self._kept_on_new_rank: set[str] = set()
        self._sharded: set[str] = set()

    def register(self, name: str, part: Stateful, *, per_rank: bool = False, kept_on_new_rank: bool = False,
                 sharded: bool = False) -> None:
        """Add `part` under `name`; `per_rank`, `kept_on_new_rank`, `sharded`: see the module docstring."""
        if kept_on_new_rank and not per_rank:
            raise ValueError(f"state part {name!r}: kept_on_new_rank needs per_rank")
        if sharded and per_rank:
            raise ValueError(f"state part {name!r}: a part is sharded or per rank, not both")
        if name in self._parts:
            raise ValueError(f"state part {name!r} is registered twice")
        if not isinstance(part, Stateful):
            raise TypeError(f"state part {name!r} ({type(part).__name__}) has no state_dict/load_state_dict")
        self._parts[name] = part
        if per_rank:
            self._per_rank.add(name)
        if kept_on_new_rank:
            self._kept_on_new_rank.add(name)
        if sharded:
            self._sharded.add(name)

    @property
    def per_rank(self) -> frozenset[str]:
        """The parts each rank saves for itself."""
        return frozenset(self._per_rank)

    @property
    def sharded(self) -> frozenset[str]:
        """The parts every rank writes its own shards of (FSDP)."""
        return frozenset(self._sharded)

    @property
    def kept_on_new_rank(self) -> frozenset[str]:
        """The per-rank parts a rank new to the run keeps rather than take from rank 0."""
        return frozenset(self._kept_on_new_rank)

    def parts(self) -> dict[str, Stateful]:
        """Parts in restore order: everything else first, `rng` last."""
        ordered = {k: v for k, v in self._parts.items() if k != "rng"}
        if "rng" in self._parts:
            ordered["rng"] = self._parts["rng"]
        return ordered

    def __iter__(self) -> Iterator[str]:
        return iter(self.parts())

    def __contains__(self, name: str) -> bool:
        return name in self._parts


class TrainerCounters:
    """The trainer's own progress: the step, tokens seen, a digest of every loss so far, and the
    anomaly ledger (skipped batches and rollbacks, harness/health/anomaly.py).

    `loss_digest` chains the exact bits of each step's loss (sha256), so two runs that agree on
    the digest at step N logged the same losses at steps 1..N. The ledger is saved only once it
    holds something, so runs without rollbacks or spike checks keep the state dict they had.
    """

    def __init__(self) -> None:
        self.step = 0
        self.tokens_seen = 0
        self.loss_digest = hashlib.sha256(b"harness").hexdigest()
        self.finished = False
        self.anomalies = AnomalyLedger()

    def record(self, loss: float, tokens: int) -> None:
        self.step += 1
        self.tokens_seen += tokens
        h = hashlib.sha256(bytes.fromhex(self.loss_digest))
        h.update(struct.pack("<qd", self.step, loss))
        self.loss_digest = h.hexdigest()

    def state_dict(self) -> dict[str, Any]:
        state = {"step": self.step, "tokens_seen": self.tokens_seen, "loss_digest": self.loss_digest,
                 "finished": self.finished}
        if self.anomalies:
            state["anomalies"] = self.anomalies.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.tokens_seen = int(state["tokens_seen"])
        self.loss_digest = str(state["loss_digest"])
        self.finished = bool(state["finished"])
        self.anomalies.load_state_dict(state.get("anomalies", {}))
