"""`IteratorStream`: training batches drawn from a user's stateful iterator (`data.factory`).

Contract (the user's side is in factory.py):
- Each item the iterator gives becomes a sample and its id through `sample(item, index)` (a
  language model's data.factory: `token_sample`, factory.py, which checks `(x, y[, sample_id])`;
  a task's: the item itself, its id the global index), and `batch_size` samples a batch through
  `collate` (batch.py's default).
- The harness calls `iter(source)` once, lazily, before the first batch and again after every
  `load_state_dict`, and draws `batch_size` samples per batch from that iterator, in the
  training process (no loader workers: the iterator's `state_dict()` must describe exactly the
  samples delivered, so anything read ahead is the iterator's own business).
- `state_dict()` is this rank's count of samples delivered, its rank and world size, and the
  iterator's own `state_dict()` (taken after the last delivered batch). `load_state_dict()`
  gives the iterator back what it saved (tuples come back as lists: the checkpoint is JSON plus
  safetensors, never pickle) and refuses a state saved by another rank or world size: the
  harness cannot re-split a user's iterator, it can only hand it back to the rank that saved it.
- A batch's `position` is the global index of its first sample, counting every rank's samples
  (rank r's b-th sample is global sample b * world + r, as in order.py); a sample without an id
  of its own gets that global index as its id.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import default_collate

from harness.checkpoint.format import capture
from harness.data.batch import Batch, Collate
from harness.errors import StorageError, UserError

SampleOf = Callable[[Any, int], tuple[Any, int]]  # (item, global index) -> (sample, sample id)


def as_sample(item: Any, index: int) -> tuple[Any, int]:
    """A task iterator's item is the sample; its id is its global index."""
    return item, index


class IteratorStream:
    """Batches of `batch_size` samples from `source` (a stateful iterable) for `rank` of `world_size`."""

    def __init__(self, source: Any, batch_size: int, sample: SampleOf = as_sample, *, rank: int = 0,
                 world_size: int = 1, collate: Collate | None = None):
        self.source = source
        self.batch_size = batch_size
        self.sample = sample
        self.collate = collate or default_collate
        self.rank = rank
        self.world_size = world_size
        self.samples = 0  # delivered by this rank
        self._iterator: Iterator[Any] | None = None
        self._check_checkpointable()

    @property
    def saved_members(self) -> tuple[Any, ...]:
        """The iterator, whose state this part saves (harness/repro/completeness.py: covered wherever held)."""
        return (self.source,)

    def __iter__(self) -> IteratorStream:
        return self

    def __next__(self) -> Batch:
        if self._iterator is None:
            self._iterator = iter(self.source)
        first = self.samples
        samples, ids = [], []
        for n in range(self.batch_size):
            try:
                item = next(self._iterator)
            except StopIteration:
                raise UserError(f"the data.factory iterator ended after {first + n} samples on rank {self.rank}: "
                                "it must be endless (start the next epoch itself)") from None
            sample, sample_id = self.sample(item, (first + n) * self.world_size + self.rank)
            samples.append(sample)
            ids.append(sample_id)
        self.samples += self.batch_size
        return Batch(self.collate(samples), torch.tensor(ids, dtype=torch.long), epoch=0,
                     position=first * self.world_size + self.rank)

    def state_dict(self) -> dict[str, Any]:
        return {"samples": self.samples, "rank": self.rank, "world_size": self.world_size,
                "iterator": self.source.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = (int(state["rank"]), int(state["world_size"]))
        if saved != (self.rank, self.world_size):
            raise UserError(
                f"the data.factory iterator's state was saved by rank {saved[0]} of {saved[1]}, and this is rank "
                f"{self.rank} of {self.world_size}: the harness cannot re-split a user's iterator across another "
                f"number of ranks. Resume with {saved[1]} ranks, or return a map-style source from the factory "
                "(the harness's global order re-splits those)")
        self.source.load_state_dict(state["iterator"])
        self.samples = int(state["samples"])
        self._iterator = None

    def close(self) -> None:
        """Drop the iterator; the next batch calls `iter(source)` again (at the same position)."""
        self._iterator = None

    def _check_checkpointable(self) -> None:
        """At start, not at the first save: a state the checkpoint format cannot hold is a UserError."""
        try:
            capture({"data": self.state_dict()}, per_rank=("data",))
        except StorageError as e:
            raise UserError(f"the data.factory iterator's state_dict() cannot be checkpointed: {e}") from None
