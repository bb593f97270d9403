"""Two optimizers stepping at different cadences, each with its own scheduler, trained by the
harness as a task with a whole step (docs/tasks.md): a small GAN on 2-D points drawn from a ring
of eight Gaussians. The critic steps at every step (Adam, a torch StepLR); the generator at every
`generator_every`-th step (Adam, a torch LambdaLR warm-up), on the critic as it then is.

    harness train examples/two_cadences.toml

The step decides by `info.step` which optimizer steps and returns that in `StepLoss`; the harness
does the backward, accumulation, reductions, clipping and non-finite checks over the optimizer
that steps, and drops the gradients the other one received. The noise the generator reads comes
from the global torch generator (dropout's too), which the harness saves and restores: the run
resumes bit for bit after a kill and at another world size (exact elastic mode).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from harness.task import SeededSamples, StepLoss

NOISE = 8


def ring_point(g: torch.Generator) -> torch.Tensor:
    """One point of one of 8 Gaussians on a circle, drawn from `g`."""
    angle = 2 * math.pi * int(torch.randint(8, (), generator=g)) / 8
    return torch.tensor([math.cos(angle), math.sin(angle)]) * 2 + 0.05 * torch.randn(2, generator=g)


def mlp(inputs: int, width: int, outputs: int, dropout: float = 0.0) -> nn.Sequential:
    return nn.Sequential(nn.Linear(inputs, width), nn.ReLU(), nn.Dropout(dropout), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, outputs))


class TwoCadences:
    """The task: `task.args` = {width, generator_every, samples}."""

    def __init__(self, args: dict[str, Any]) -> None:
        self.width = int(args.get("width", 32))
        self.generator_every = int(args.get("generator_every", 2))
        self.samples = int(args.get("samples", 4096))
        if self.generator_every < 1:
            raise ValueError("generator_every must be >= 1")

    def data(self, ctx) -> tuple[SeededSamples, SeededSamples]:
        return (SeededSamples(self.samples, ctx.seed, ring_point),
                SeededSamples(256, ctx.seed + 1, ring_point))

    def models(self, ctx) -> dict[str, nn.Module]:
        return {"generator": mlp(NOISE, self.width, 2), "critic": mlp(2, self.width, 1, dropout=0.1)}

    def optimizers(self, models: nn.ModuleDict, ctx) -> tuple[dict, dict]:
        generator = torch.optim.Adam(models["generator"].parameters(), lr=1e-3, betas=(0.5, 0.9))
        critic = torch.optim.Adam(models["critic"].parameters(), lr=2e-3, betas=(0.5, 0.9))
        schedulers = {"generator": torch.optim.lr_scheduler.LambdaLR(generator, lambda s: min(1.0, (s + 1) / 10)),
                      "critic": torch.optim.lr_scheduler.StepLR(critic, step_size=20, gamma=0.5)}
        return {"generator": generator, "critic": critic}, schedulers

    def step(self, models: nn.ModuleDict, optim, real: torch.Tensor, info) -> StepLoss:
        noise = torch.randn(len(real), NOISE, device=real.device)
        fake = models["generator"](noise)
        if info.step % self.generator_every == 0:
            return StepLoss(F.softplus(-models["critic"](fake)).mean(), optimizers=("generator",))
        critic_loss = F.softplus(models["critic"](fake.detach())).mean() + F.softplus(-models["critic"](real)).mean()
        return StepLoss(critic_loss, optimizers=("critic",))

    def evaluate(self, models: nn.ModuleDict, batches) -> dict[str, float]:
        """The critic's loss on held-out points against a fixed set of generated ones, and how far
        the generated points lie from the ring (radius 2)."""
        noise = torch.randn(256, NOISE, generator=torch.Generator().manual_seed(0))
        fake = models["generator"](noise.to(next(models.parameters()).device))
        real = torch.cat(list(batches))
        critic = F.softplus(models["critic"](fake)).mean() + F.softplus(-models["critic"](real)).mean()
        return {"critic_loss": float(critic), "ring_distance": float((fake.norm(dim=1) - 2).abs().mean())}


def build(args: dict[str, Any]) -> TwoCadences:
    return TwoCadences(args)
