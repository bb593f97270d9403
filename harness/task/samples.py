"""SeededSamples: a map-style source of synthetic samples that any process can draw alike.

Sample `i` is `draw(generator)` with a fresh CPU generator seeded by (seed, i), so a sample does not
depend on which rank reads it, in what order, or on any generator the training draws from: what
exact resume and elastic resume need of a source (docs/tasks.md)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

import torch

Sample = TypeVar("Sample")

# Spreads the seeds of consecutive runs' samples apart: (seed, i) and (seed + 1, i) seed no common generator.
_SEED_STRIDE = 1_000_003


class SeededSamples(Generic[Sample]):
    """`count` samples; sample `i` is `draw(torch.Generator().manual_seed(seed * 1_000_003 + i))`."""

    def __init__(self, count: int, seed: int, draw: Callable[[torch.Generator], Sample]) -> None:
        self.count, self.seed, self.draw = count, seed, draw

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> Sample:
        if not 0 <= i < self.count:
            raise IndexError(f"sample {i} of {self.count}")
        return self.draw(torch.Generator().manual_seed(self.seed * _SEED_STRIDE + i))
