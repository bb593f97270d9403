"""The `closure` argument of `torch.optim.Optimizer.step`, handled once for every optimizer here."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

Loss = TypeVar("Loss")


def run_closure(closure: Callable[[], Loss] | None) -> Loss | None:
    """Re-evaluate the loss with gradients on (step itself runs under no_grad); None if no closure."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()
