"""`Batch`: what the trainer receives, with the cursor it came from; `fetch_samples`, the one way
samples become a batch (the training stream, its loader workers and evaluation alike)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import default_collate

from harness.data.dataset import SampleSource

Collate = Callable[[list[Any]], Any]


@dataclass(frozen=True)
class Batch:
    """The collated samples (`inputs`: any nest of tensors; a language model's is the pair of
    inputs and targets `(x, y)`, int64 [B, T]), the samples' ids ([B]), and the cursor (`epoch`,
    global `position`) of the batch's first sample."""

    inputs: Any
    sample_ids: torch.Tensor
    epoch: int
    position: int

    @property
    def x(self) -> torch.Tensor:
        """A language model's inputs: the first of the pair."""
        return self.inputs[0]

    @property
    def y(self) -> torch.Tensor:
        """A language model's targets: the second of the pair."""
        return self.inputs[1]

    def __len__(self) -> int:
        return len(self.sample_ids)


def fetch_samples(dataset: SampleSource, indices: torch.Tensor,
                  collate: Collate | None = None) -> tuple[Any, torch.Tensor]:
    """The samples at `indices` collated into one batch, and their ids. A dataset with
    `windows(indices)` (token windows of seq_len + 1) is read in one call, as the pair (x, y);
    any other sample by sample, then `collate` (default: torch's `default_collate`, which stacks
    the tensors of a nest of tensors)."""
    positions = indices.tolist()
    sample_ids = torch.tensor([dataset.sample_id(i) for i in positions], dtype=torch.long)
    if hasattr(dataset, "windows"):
        windows = dataset.windows(positions)
        return (windows[:, :-1].contiguous(), windows[:, 1:].contiguous()), sample_ids
    return (collate or default_collate)([dataset[i] for i in positions]), sample_ids


def split_batch(inputs: Any, size: int) -> list[Any]:
    """A collated nest cut along its first dimension into pieces of `size` samples (exact elastic
    mode's micro-batches of a rank's block): tensors are split, tuples, lists and dicts recursed."""
    if isinstance(inputs, torch.Tensor):
        return list(inputs.split(size))
    if isinstance(inputs, dict):
        pieces = {k: split_batch(v, size) for k, v in inputs.items()}
        return [{k: v[n] for k, v in pieces.items()} for n in range(len(next(iter(pieces.values()))))]
    if isinstance(inputs, (tuple, list)):
        columns = [split_batch(v, size) for v in inputs]
        return [type(inputs)(column[n] for column in columns) for n in range(len(columns[0]))]
    raise TypeError(f"a batch holds a {type(inputs).__name__}: only tensors, and tuples, lists and dicts of them, "
                    "can be cut into micro-batches")


def to_device(inputs: Any, device: torch.device, *, copy: bool = False) -> Any:
    """Every tensor of the nest `inputs` on `device` (non-blocking from pinned memory; `copy`: a
    fresh tensor even where it is there already), other leaves as they are."""
    if isinstance(inputs, torch.Tensor):
        return inputs.to(device, non_blocking=True, copy=copy)
    if isinstance(inputs, dict):
        return {k: to_device(v, device, copy=copy) for k, v in inputs.items()}
    if isinstance(inputs, (tuple, list)):
        return type(inputs)(to_device(v, device, copy=copy) for v in inputs)
    return inputs
