"""A model factory with a planted resume fault, for `harness verify-resume` in real processes.

Use with `--set model.factory="faulty_models:noisy_gpt"` and `tests/verify` on PYTHONPATH.
"""

from __future__ import annotations

import torch
from torch import nn

from harness.models import build_gpt


class NoisyGPT(nn.Module):
    """The GPT, with a loss term drawn from the model's own generator, which no state part saves
    (a module's state_dict holds parameters and buffers only)."""

    def __init__(self, args: dict) -> None:
        super().__init__()
        self.gpt = build_gpt(args)
        self.noise = torch.Generator().manual_seed(5)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None):
        logits, loss = self.gpt(x, y)
        if loss is not None and self.training:
            loss = loss * (1.0 + 0.01 * torch.rand((), generator=self.noise))
        return logits, loss


def noisy_gpt(args: dict) -> NoisyGPT:
    return NoisyGPT(args)
