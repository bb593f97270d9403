"""Users' own tasks for real `harness train` processes and in-process trainers: `--set
task.factory="tests.user_tasks:NAME"` with tests/task/tasks.toml (the processes run in the
repository root, where `tests` imports)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from harness.task import StepInfo


class Points:
    def __len__(self) -> int:
        return 256

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(4, generator=torch.Generator().manual_seed(i))
        return x, x.sum(0, keepdim=True)


class PartlyUsedModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 1)
        self.extra = nn.Parameter(torch.full((4, 1), 0.5))  # a matrix: AdamW decays it


class PartlyUsed:
    """A regression whose `extra` weight only the last micro-batch of an even step uses: on an
    even step the other micro-batches (at two ranks, all of rank 0's) give it no gradient, and
    an odd step gives it none at all, so no optimizer may step it then."""

    def data(self, ctx) -> tuple[Points, Points]:
        return Points(), Points()

    def models(self, ctx) -> PartlyUsedModel:
        return PartlyUsedModel()

    def step(self, model: PartlyUsedModel, optim, batch, info: StepInfo) -> torch.Tensor:
        x, y = batch
        out = model.linear(x)
        if info.step % 2 == 0 and info.micro_batch == info.micro_batches - 1:
            out = out + x @ model.extra
        return F.mse_loss(out, y)

    def loss(self, model: PartlyUsedModel, batch) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(model.linear(x) + x @ model.extra, y)


def partly_used(args: dict) -> PartlyUsed:
    return PartlyUsed()
