"""What this package's optimizers share: the per-parameter state each declares (the bundle checks
a loaded state against it, optim/bundle.py), and the 2D-only contract of the matrix optimizers
(Muon, OLion, Adafactor2D)."""

from __future__ import annotations

import torch

from optim.newton_schulz import require_matrices


class Optimizer(torch.optim.Optimizer):
    """`STATE`: the names of the tensors kept per parameter once it has stepped, each shaped like
    the parameter; an optimizer whose state has other shapes overrides `state_shapes`."""

    STATE: tuple[str, ...] = ()

    @classmethod
    def state_shapes(cls, p: torch.Tensor) -> dict[str, tuple[int, ...]]:
        """The state kept per parameter once it has stepped, with its shapes."""
        return {name: tuple(p.shape) for name in cls.STATE}


class MatrixOptimizer(Optimizer):
    """Takes 2D parameters only: every group added is checked (`require_matrices`)."""

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        require_matrices(self, self.param_groups[-1])
