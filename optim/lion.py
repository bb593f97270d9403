"""Lion: the sign of an interpolated momentum, with decoupled weight decay.

Source: Chen et al., "Symbolic Discovery of Optimization Algorithms" (2023), arXiv:2302.06675.

Update, per parameter p with gradient g (the team's reference rule; any shape):
    u <- sign(beta1 * m + (1 - beta1) * g)
    p <- p * (1 - lr * wd)                      (only when wd > 0)
    p <- p - lr * u
    m <- beta2 * m + (1 - beta2) * g            (after the update: the interpolation uses m_{t-1})

Elementwise, so a sharded parameter (DTensor) steps on its local shard with its local state:
bitwise the one-process step, no communication (optim/sharded.py).
"""

from collections.abc import Callable, Iterable
from typing import overload

import torch
from torch.optim.optimizer import ParamsT

from optim.base import Optimizer
from optim.closure import run_closure
from optim.dtensor import local


class Lion(Optimizer):
    """Lion over parameters of any shape. State per parameter: `m` (momentum, shape of p).

    Args: lr (3e-4), betas ((0.9, 0.99); a list is accepted), wd (0.0, decoupled).
    """

    STATE = ("m",)

    def __init__(self, params: ParamsT, lr: float = 3e-4, betas: Iterable[float] = (0.9, 0.99), wd: float = 0.0):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), wd=wd))

    @overload
    def step(self, closure: None = None) -> None: ...
    @overload
    def step(self, closure: Callable[[], float]) -> float: ...
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = run_closure(closure)
        for group in self.param_groups:
            b1, b2 = group["betas"]
            lr, wd = group["lr"], group["wd"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                w, g, m = local(p), local(p.grad), local(self.state_of(p)["m"])
                u = (b1 * m + (1 - b1) * g).sign_()
                if wd > 0:
                    w.mul_(1 - lr * wd)
                w.add_(u, alpha=-lr)
                m.mul_(b2).add_(g, alpha=1 - b2)
        return loss
