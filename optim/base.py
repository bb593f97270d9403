"""What this package's optimizers share: the per-parameter state each declares (the bundle checks
a loaded state against it, optim/bundle.py), created when a parameter joins the optimizer, and the
2D-only contract of the matrix optimizers (Muon, OLion, Adafactor2D).

State is created eagerly (zeros, when a parameter group is added, and again after a load for any
parameter the loaded state lacks), not at the first step: a parameter sharded as a DTensor gets
DTensor state with its placement (optim/sharded.py), so `torch.distributed.checkpoint` sees the
same keys on every rank before the first step (microsoft/dion#18, pytorch/pytorch#140898), and
its `get_state_dict` never initialises state with a zero-gradient step of its own (which would
move Adafactor's statistics), for sharded and plain parameters alike. Zeros are what the lazy
creation made, so the math is unchanged. The state is placed where the parameter is when the
optimizer is built: build it after moving the model to its device and after `fully_shard` (which
replaces the parameters), as torch's FSDP2 documentation asks for every optimizer.
"""

from __future__ import annotations

from typing import Any

import torch

from optim.newton_schulz import require_matrices
from optim.sharded import layout_of


class Optimizer(torch.optim.Optimizer):
    """`STATE`: the names of the tensors kept per parameter, each shaped like the parameter; an
    optimizer whose state has other shapes overrides `state_shapes` and `initial_state`."""

    STATE: tuple[str, ...] = ()

    @classmethod
    def state_shapes(cls, p: torch.Tensor) -> dict[str, tuple[int, ...]]:
        """The state kept per parameter, with its (global) shapes."""
        return {name: tuple(p.shape) for name in cls.STATE}

    def initial_state(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        """Fresh state of `p`: zeros like `p` (its dtype, device and, for a DTensor, placement)."""
        return {name: torch.zeros_like(p) for name in self.STATE}

    def check_group(self, group: dict[str, Any]) -> None:
        """Raise ValueError for a parameter group this optimizer cannot take (none here)."""

    def state_of(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        """`p`'s state, created by `initial_state` if it has none."""
        state: dict[str, torch.Tensor] = self.state[p]  # torch types its state values Any
        if not state:
            state.update(self.initial_state(p))
        return state

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        self.check_group(group)
        for p in group["params"]:
            self.state_of(p)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            for p in group["params"]:
                self.state_of(p)


class MatrixOptimizer(Optimizer):
    """Takes 2D parameters only, plain or sharded on one mesh dimension: every group added is
    checked (`require_matrices`, `optim.sharded.layout_of`)."""

    def check_group(self, group: dict[str, Any]) -> None:
        require_matrices(self, group)
        names = group.get("param_names") or [f"params[{i}]" for i in range(len(group["params"]))]
        for name, p in zip(names, group["params"], strict=True):
            layout_of(p, f"{type(self).__name__} parameter {name!r}")
