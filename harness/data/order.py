"""The data order: which samples each rank gets, as a pure function of the cursor.

Epoch `e` visits the dataset in the order `epoch_permutation(seed, e, n)`. The cursor position
`P` counts samples of that permutation consumed by *all* ranks together, so it means the same
thing for any world size: a global batch is the next `batch_size * world_size` entries, and
rank `r` takes every `world_size`-th of them starting at `r`. Because ranks only ever split what
lies after `P`, a run resumed with a different world size re-splits the rest of the epoch and no
sample is repeated or skipped within it. With `drop_last`, a tail shorter than a global batch is
skipped, so every rank gets the same number of equal batches.
"""

from __future__ import annotations

import torch

from harness.data.prng import derive_seed


def epoch_permutation(seed: int, epoch: int, num_samples: int) -> torch.Tensor:
    """A permutation of `range(num_samples)` that depends only on (seed, epoch, num_samples)."""
    generator = torch.Generator().manual_seed(derive_seed(seed, epoch))
    return torch.randperm(num_samples, generator=generator)


def rank_batches(
    permutation: torch.Tensor, position: int, batch_size: int, rank: int, world_size: int, drop_last: bool
) -> list[torch.Tensor]:
    """This rank's remaining batches of the epoch from global `position`, as sample indices.

    Without `drop_last` (only for world_size 1) the last batch may be shorter.
    """
    global_batch = batch_size * world_size
    remaining = permutation[position:]
    full = remaining.numel() // global_batch
    batches = list(remaining[: full * global_batch].view(full, batch_size, world_size)[:, :, rank])
    if not drop_last and remaining.numel() > full * global_batch:
        batches.append(remaining[full * global_batch :])
    return batches


def epoch_ended(position: int, num_samples: int, global_batch: int, drop_last: bool) -> bool:
    """Whether a cursor at `position` has no batch left in its epoch."""
    left = num_samples - position
    return left < global_batch if drop_last else left <= 0
