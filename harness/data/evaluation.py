"""`eval_batches`: the held-out set in a fixed order, no RNG, so every eval sees the same data."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from harness.data.batch import Batch, Collate, fetch_samples
from harness.data.dataset import SampleSource


def eval_batches(dataset: SampleSource, batch_size: int, max_batches: int | None,
                 collate: Collate | None = None) -> Iterator[Batch]:
    """Samples 0, 1, 2, ... in batches of `batch_size` (the last may be shorter), at most
    `max_batches` of them (None: the whole dataset), made by `collate` (batch.py's default)."""
    total = dataset.num_samples
    for count, start in enumerate(range(0, total, batch_size)):
        if max_batches is not None and count >= max_batches:
            return
        inputs, sample_ids = fetch_samples(dataset, torch.arange(start, min(start + batch_size, total)), collate)
        yield Batch(inputs, sample_ids, epoch=0, position=start)
