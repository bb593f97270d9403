"""OLion: Lion-style momentum, orthogonalised by Newton-Schulz, then an entrywise sign.

Source: arXiv:2602.01105 (OLion). The sign of the orthogonalised direction has Frobenius norm
sqrt(numel) exactly, so the RMS-alignment factor gamma sets the update's RMS directly:
D = gamma * sign(Q). betas default to Lion's (0.9, 0.99); the paper's defaults were not in the
pages the team read (an assumption carried over from the reference).

Update, per 2D parameter p with gradient g (the team's reference rule):
    m  <- beta2 * m + (1 - beta2) * g          (slow momentum, updated first)
    gt <- (1 - beta1) * g + beta1 * m          (Nesterov-style mix)
    Q  <- NewtonSchulz(gt)                      (optim.newton_schulz, shared with Muon; float32)
    p  <- p * (1 - lr * wd)                     (only when wd > 0)
    p  <- p - lr * gamma * sign(Q)

Sharded parameters (DTensors, FSDP2): the momentum and the mix run on local shards, each whole
mixed matrix is orthogonalised once, on one rank, and its shards sent back (optim.sharded, as
for Muon): bitwise the one-process step on a CPU.
"""

from collections.abc import Callable, Iterable
from typing import overload

import torch
from torch.optim.optimizer import ParamsT

from optim.base import MatrixOptimizer
from optim.closure import run_closure
from optim.dtensor import local, local_grad
from optim.sharded import matrix_rounds, orthogonalize_matrices


class OLion(MatrixOptimizer):
    """OLion over 2D parameters. State per parameter: `m` (momentum, shape of p).

    Args: lr (1e-3), betas ((0.9, 0.99)), gamma (0.2), ns_steps (5), wd (0.0, decoupled),
    ns_batched (None: stack same-shape matrices when faster). NS runs in float32 whatever the
    parameter dtype, where the reference runs it in the parameter dtype: bitwise the reference
    for float32 parameters; for bfloat16 ones Q differs by bfloat16 roundings and the update,
    its sign, differs only where an entry of Q near zero changes sign.
    Raises ValueError for a non-2D parameter, naming it.
    """

    STATE = ("m",)

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        betas: Iterable[float] = (0.9, 0.99),
        gamma: float = 0.2,
        ns_steps: int = 5,
        wd: float = 0.0,
        ns_batched: bool | None = None,
    ):
        defaults = dict(
            lr=lr, betas=tuple(betas), gamma=gamma, ns_steps=ns_steps, wd=wd, ns_batched=ns_batched
        )
        super().__init__(params, defaults)

    @overload
    def step(self, closure: None = None) -> None: ...
    @overload
    def step(self, closure: Callable[[], float]) -> float: ...
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = run_closure(closure)
        for group in self.param_groups:
            (b1, b2), lr, wd = group["betas"], group["lr"], group["wd"]
            params = [p for p in group["params"] if p.grad is not None]
            for batch in matrix_rounds(params, group["ns_batched"], torch.float32):
                mixed = []
                for p in batch:
                    g, m = local_grad(p), local(self.state_of(p)["m"])
                    m.mul_(b2).add_(g, alpha=1 - b2)
                    mixed.append((1 - b1) * g + b1 * m)
                for p, q in zip(batch, orthogonalize_matrices(batch, mixed, group["ns_steps"], torch.float32,
                                                              group["ns_batched"]), strict=True):
                    w = local(p)
                    if wd > 0:
                        w.mul_(1 - lr * wd)
                    w.add_(q.sign_(), alpha=-lr * group["gamma"])
        return loss
