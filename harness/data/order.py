"""The data order: which samples each rank gets, as a pure function of the cursor.

Epoch `e` visits the dataset in the order `epoch_permutation(seed, e, n)`. The cursor position
`P` counts samples of that permutation consumed by *all* ranks together, so it means the same
thing for any world size: a global batch is the next `batch_size * world_size` entries, and
rank `r` takes every `world_size`-th of them starting at `r`. Because ranks only ever split what
lies after `P`, a run resumed with a different world size re-splits the rest of the epoch and no
sample is repeated or skipped within it. With `drop_last`, a tail shorter than a global batch is
skipped, so every rank gets the same number of equal batches.

`parallel.exact_elastic` splits contiguously instead (`rank_block`): the global batch is a whole
step, cut into canonical micro-batches in cursor order, and rank `r` takes the `r`-th block of
them, so a micro-batch holds the same samples whichever rank computes it.
"""

from __future__ import annotations

import torch

from harness.repro.splitmix import derive_seed


def epoch_permutation(seed: int, epoch: int, num_samples: int) -> torch.Tensor:
    """A permutation of `range(num_samples)` that depends only on (seed, epoch, num_samples)."""
    generator = torch.Generator().manual_seed(derive_seed(seed, epoch))
    return torch.randperm(num_samples, generator=generator)


def rank_batch(permutation: torch.Tensor, position: int, batch_size: int, rank: int, world_size: int) -> torch.Tensor:
    """The sample indices of this rank's batch in the global batch starting at `position`.

    A short final global batch (only without `drop_last`, so only for world_size 1) gives a
    short batch.
    """
    return permutation[position : position + batch_size * world_size][rank::world_size]


def rank_block(permutation: torch.Tensor, position: int, block: int, rank: int) -> torch.Tensor:
    """The sample indices of rank `rank`'s contiguous block of `block` samples in the global batch
    starting at `position` (the exact-elastic split: module docstring)."""
    return permutation[position + rank * block : position + (rank + 1) * block]


def batches_left(position: int, num_samples: int, global_batch: int, drop_last: bool) -> int:
    """How many batches a cursor at `position` has left in its epoch."""
    left = num_samples - position
    return left // global_batch if drop_last else -(-left // global_batch)
