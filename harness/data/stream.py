"""`BatchStream`: an endless, seekable stream of training batches for one rank.

Contract:
- The batches are a pure function of (dataset size, seed, batch_size, rank, world_size) and the
  cursor (`epoch`, `position`); see `harness.data.order`. They do not depend on `num_workers`.
- `state_dict()` is the cursor of the next batch to *deliver*: batches that worker processes
  prefetched but the trainer never received are not counted, so a resume redoes none and skips
  none.
- `load_state_dict()` seeks in O(1): it sets the cursor and nothing else; the next batch builds
  the epoch's permutation and reads only the samples it delivers.
- One loader, with one set of worker processes, reads on from its cursor across epochs (each
  process builds an epoch's permutation when it first reaches it); only `load_state_dict()` and
  `close()` stop it. Prefetch depth: the DataLoader's, 2 batches per worker.
- `pin_memory` (for a CUDA device; only with workers, where the loader's own thread pins batches
  ahead of the step, in the training process it would be one more copy in the step) delivers
  batches in page-locked memory, so their copy to the device can be asynchronous.
- `contiguous` (parallel.exact_elastic): a rank's batch is its contiguous block of the global
  batch (`order.rank_block`) instead of every world_size-th sample; the cursor is the same.
- `collate` makes a batch of samples (default: torch's `default_collate`; batch.py's
  `fetch_samples`), in the loader workers where there are any.
- The stream never touches the process's global RNGs (the trainer's dropout depends on them):
  the permutation and the DataLoader's worker seeds come from dedicated generators.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from harness.data.batch import Batch, Collate, fetch_samples
from harness.data.dataset import SampleSource
from harness.data.order import batches_left, epoch_permutation, rank_batch, rank_block
from harness.errors import UserError
from harness.repro.splitmix import derive_seed

EPOCHS_AHEAD = 1 << 20  # epochs one loader serves before the stream opens another (at its cursor)


class _BatchesAhead(Dataset):
    """The batches of one rank from the cursor on, across epochs, one item per batch, so a
    worker builds whole batches and one set of workers serves every epoch (starting workers
    anew at each epoch made the step wait for them). Item `k` is the `k`-th batch after the
    cursor the loader was opened at; its (epoch, position) follows from arithmetic, since every
    full epoch has the same number of batches."""

    def __init__(self, stream: BatchStream):
        self.dataset = stream.dataset
        self.collate = stream.collate
        self.seed = stream.seed
        self.epoch = stream.epoch
        self.start = stream.position
        self.batch_size = stream.batch_size
        self.rank = stream.rank
        self.world_size = stream.world_size
        self.contiguous = stream.contiguous
        self.global_batch = stream.global_batch_size
        self.in_first_epoch = batches_left(stream.position, self.dataset.num_samples, self.global_batch,
                                           stream.drop_last)
        self.per_epoch = batches_left(0, self.dataset.num_samples, self.global_batch, stream.drop_last)
        self._view: tuple[int, SampleSource, torch.Tensor] | None = None  # this process's epoch in hand

    def __len__(self) -> int:
        return self.in_first_epoch + self.per_epoch * EPOCHS_AHEAD

    def cursor(self, index: int) -> tuple[int, int]:
        """(epoch, position) of item `index`."""
        if index < self.in_first_epoch:
            return self.epoch, self.start + index * self.global_batch
        later = index - self.in_first_epoch
        return self.epoch + 1 + later // self.per_epoch, (later % self.per_epoch) * self.global_batch

    def __getitem__(self, index: int) -> tuple[Any, torch.Tensor] | UserError:
        epoch, position = self.cursor(index)
        dataset, permutation = self._epoch(epoch)
        indices = (rank_block(permutation, position, self.batch_size, self.rank) if self.contiguous
                   else rank_batch(permutation, position, self.batch_size, self.rank, self.world_size))
        try:
            return fetch_samples(dataset, indices, self.collate)
        except UserError as e:
            # Handed back as a value: re-raised by a DataLoader, it would carry the worker's
            # traceback in its message, and a user error is one line.
            return e

    def _epoch(self, epoch: int) -> tuple[SampleSource, torch.Tensor]:
        """The dataset's view of `epoch` and its permutation, built once per epoch per process."""
        if self._view is None or self._view[0] != epoch:
            # A mixture maps its slots to samples per epoch (mixture.py); other datasets are epoch-free.
            for_epoch = getattr(self.dataset, "for_epoch", None)
            dataset = for_epoch(epoch) if for_epoch is not None else self.dataset
            self._view = (epoch, dataset, epoch_permutation(self.seed, epoch, self.dataset.num_samples))
        return self._view[1], self._view[2]


class BatchStream:
    """Batches of `batch_size` samples for `rank` of `world_size`, epoch after epoch, forever."""

    def __init__(
        self,
        dataset: SampleSource,
        batch_size: int,
        seed: int,
        *,
        rank: int = 0,
        world_size: int = 1,
        num_workers: int = 0,
        drop_last: bool = True,
        pin_memory: bool = False,
        contiguous: bool = False,
        collate: Collate | None = None,
    ):
        if batch_size < 1 or num_workers < 0 or not 0 <= rank < world_size:
            raise ValueError(
                f"bad stream shape: batch_size={batch_size} rank={rank} "
                f"world_size={world_size} num_workers={num_workers}"
            )
        if not drop_last and world_size > 1:
            raise UserError(
                "drop_last=False needs world_size 1: ranks would get unequal last batches; use drop_last=True"
            )
        if dataset.num_samples < batch_size * world_size:
            raise UserError(
                f"the dataset has {dataset.num_samples} samples, fewer than one global batch "
                f"(batch_size {batch_size} x world_size {world_size}): use a larger dataset or smaller batches"
            )
        self.dataset = dataset
        self.batch_size = batch_size
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.num_workers = num_workers
        self.drop_last = drop_last
        self.pin_memory = pin_memory and num_workers > 0
        self.contiguous = contiguous
        self.collate = collate
        self.epoch = 0
        self.position = 0
        self._pending: Iterator[tuple[Any, torch.Tensor] | UserError] | None = None

    @property
    def global_batch_size(self) -> int:
        return self.batch_size * self.world_size

    def __iter__(self) -> BatchStream:
        return self

    def __next__(self) -> Batch:
        if self._pending is None:
            self._pending = self._open()
        item = next(self._pending, None)
        if item is None:  # EPOCHS_AHEAD epochs read: open again at the cursor
            self._pending = self._open()
            item = next(self._pending)
        if isinstance(item, UserError):
            self.close()
            raise item
        inputs, sample_ids = item
        batch = Batch(inputs, sample_ids, epoch=self.epoch, position=self.position)
        # Without drop_last the final batch may be short; it still ends the epoch.
        self.position = min(self.position + self.global_batch_size, self.dataset.num_samples)
        self._roll_over_if_epoch_ended()
        return batch

    def state_dict(self) -> dict:
        """The cursor of the next batch to deliver, plus what the order depends on (checked on load)."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "num_samples": self.dataset.num_samples,
        }

    def load_state_dict(self, state: dict) -> None:
        """Seek to a saved cursor. The world size and batch size may differ from the saving run's."""
        for key, expected in (("seed", self.seed), ("num_samples", self.dataset.num_samples)):
            if state[key] != expected:
                raise UserError(
                    f"the data cursor was saved with {key}={state[key]} but this run has {key}={expected}: "
                    "the sample order would differ; resume with the original data and seed"
                )
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position <= self.dataset.num_samples:
            raise UserError(
                f"data cursor epoch={epoch} position={position} is outside the dataset "
                f"of {self.dataset.num_samples} samples"
            )
        self.close()
        self.epoch, self.position = epoch, position
        self._roll_over_if_epoch_ended()

    def close(self) -> None:
        """Stop worker processes and drop prefetched batches; the next batch reopens at the cursor."""
        # Dropping the last reference to a DataLoader iterator shuts its workers down.
        self._pending = None

    def _roll_over_if_epoch_ended(self) -> None:
        """The open loader reads on into the next epoch; only the cursor moves."""
        if batches_left(self.position, self.dataset.num_samples, self.global_batch_size, self.drop_last) == 0:
            self.epoch += 1
            self.position = 0

    def _open(self) -> Iterator[tuple[Any, torch.Tensor] | UserError]:
        ahead = _BatchesAhead(self)
        if self.num_workers == 0:
            return (ahead[i] for i in range(len(ahead)))
        # Without `generator`, starting the loader would draw its worker base seed from the
        # global torch RNG and shift the trainer's dropout stream.
        generator = torch.Generator().manual_seed(derive_seed(self.seed, self.epoch, self.position, self.rank))
        loader = DataLoader(
            ahead,
            batch_size=None,
            shuffle=False,
            num_workers=self.num_workers,
            persistent_workers=False,
            generator=generator,
            pin_memory=self.pin_memory,
        )
        return iter(loader)
