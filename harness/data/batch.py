"""`Batch`: what the trainer receives, with the cursor it came from."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from harness.data.dataset import SampleSource


@dataclass(frozen=True)
class Batch:
    """Inputs `x` and targets `y` (int64, [B, T]), the samples' ids ([B]), and the cursor
    (`epoch`, global `position`) of the batch's first sample."""

    x: torch.Tensor
    y: torch.Tensor
    sample_ids: torch.Tensor
    epoch: int
    position: int


def fetch_samples(dataset: SampleSource, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stack the samples at `indices` into (x, y, sample_ids). A dataset with `windows(indices)`
    (token windows of seq_len + 1) is read in one call; any other sample by sample."""
    if hasattr(dataset, "windows"):
        windows = dataset.windows(indices.tolist())
        sample_ids = torch.tensor([dataset.sample_id(i) for i in indices.tolist()], dtype=torch.long)
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous(), sample_ids
    pairs = [dataset[i] for i in indices.tolist()]
    x = torch.stack([pair[0] for pair in pairs])
    y = torch.stack([pair[1] for pair in pairs])
    sample_ids = torch.tensor([dataset.sample_id(i) for i in indices.tolist()], dtype=torch.long)
    return x, y, sample_ids
