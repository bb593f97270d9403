"""Adafactor2D: Adam's second moment factored into row and column statistics, for 2D params.

Source: Shazeer & Stern, "Adafactor: Adaptive Learning Rates with Sublinear Memory Cost" (2018),
arXiv:1804.04235. Kept minimal as in the team's reference: factored second moment, RMS-1 update
clipping, no first moment, no relative step size (external lr and schedule).

Update, per 2D parameter p with gradient g (the reference rule):
    g2 <- g^2 + eps                              (float32)
    r  <- beta2 * r + (1 - beta2) * mean_cols(g2)
    c  <- beta2 * c + (1 - beta2) * mean_rows(g2)
    v  <- r c^T / max(mean(r), eps)
    u  <- g / sqrt(v)
    u  <- u * min(1, clip / rms(u))
    p  <- p * (1 - lr * wd)                      (only when wd > 0)
    p  <- p - lr * u

Departure from the reference: the max and the clip are tensor ops, not `float(...)` branches, so
a step never waits on the device (the reference synchronised twice per parameter per step).
Multiplying by an exact 1.0 when no clipping is due leaves the result bitwise the reference's.

Sharded parameters (DTensors, FSDP2; optim/sharded.py): the statistic along the sharded dimension
is sharded like it (r for row shards, FSDP2's default) and computed from local rows; the other is
replicated, and its mean over the sharded dimension, mean(r) and rms(u) are sums of the ranks'
partial sums. Those reductions are in another order than one process's, so the step equals the
one-process step to float rounding, not bitwise. The collectives are batched over the group's
parameters: one all-reduce of every partial statistic, one of every sum of squares of u.
"""

from collections.abc import Callable
from typing import Any, overload

import torch
import torch.distributed as dist
from torch.optim.optimizer import ParamsT

from optim.base import MatrixOptimizer
from optim.closure import run_closure
from optim.dtensor import local, local_grad
from optim.sharded import factor_zeros, layout_of, sharded_layout


class Adafactor2D(MatrixOptimizer):
    """Adafactor2D over 2D parameters. State per (rows, cols) parameter: `r` (rows,) and
    `c` (cols,), always float32 whatever the parameter dtype.

    Args: lr (1e-3), beta2 (0.999), eps (1e-30), clip (1.0), wd (0.0, decoupled). A sharded
    parameter's `r`/`c` is sharded where the parameter is sharded along that dimension,
    replicated otherwise.
    Raises ValueError for a non-2D parameter, naming it.
    """

    def __init__(self, params: ParamsT, lr: float = 1e-3, beta2: float = 0.999, eps: float = 1e-30,
                 clip: float = 1.0, wd: float = 0.0):
        super().__init__(params, dict(lr=lr, beta2=beta2, eps=eps, clip=clip, wd=wd))

    @staticmethod
    def state_shapes(p: torch.Tensor) -> dict[str, tuple[int, ...]]:
        """The state kept per parameter once it has stepped, with its shapes (the bundle checks
        loads against it)."""
        return {"r": (p.shape[0],), "c": (p.shape[1],)}

    def initial_state(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"r": factor_zeros(p, 0), "c": factor_zeros(p, 1)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's loader casts floating state to the parameter dtype; the statistics are kept
        in float32 (a bfloat16 r/c would change the trajectory after a resume), so they are
        re-adopted from the given dict after torch has placed everything else."""
        saved = state_dict["state"]
        super().load_state_dict(state_dict)
        params = [p for group in self.param_groups for p in group["params"]]
        for idx, entry in saved.items():
            p = params[int(idx)]
            for key in ("r", "c"):
                if key in entry:
                    self.state[p][key] = entry[key].to(device=p.device, dtype=torch.float32)

    @overload
    def step(self, closure: None = None) -> None: ...
    @overload
    def step(self, closure: Callable[[], float]) -> float: ...
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = run_closure(closure)
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            sharded = [p for p in params if layout_of(p) is not None]
            for p in params:
                if layout_of(p) is None:
                    self._step_whole(p, group)
            if sharded:
                self._step_sharded(sharded, group)
        return loss

    def _step_whole(self, p: torch.Tensor, group: dict[str, Any]) -> None:
        """The reference rule on a matrix this rank holds whole."""
        beta2, eps = group["beta2"], group["eps"]
        g = local_grad(p)
        state = self.state_of(p)
        r, c = local(state["r"]), local(state["c"])
        g2 = g.float().pow(2) + eps
        r.mul_(beta2).add_(g2.mean(1), alpha=1 - beta2)
        c.mul_(beta2).add_(g2.mean(0), alpha=1 - beta2)
        u = g / _root_second_moment(r, c, r.mean(), eps).to(g.dtype)
        rms = u.pow(2).mean().sqrt()
        _apply(local(p), u, rms, group)

    def _step_sharded(self, params: list[torch.Tensor], group: dict[str, Any]) -> None:
        """The same rule on sharded matrices: local statistics, then the cross-rank sums, batched
        over `params` per shard group (every rank calls this with the same parameters)."""
        by_group: dict[dist.ProcessGroup, list[torch.Tensor]] = {}
        for p in params:
            by_group.setdefault(sharded_layout(p).group, []).append(p)
        beta2, eps = group["beta2"], group["eps"]
        for process_group, members in by_group.items():
            partial = []
            for p in members:
                g, dim = local_grad(p), sharded_layout(p).dim
                state = self.state_of(p)
                g2 = g.float().pow(2) + eps
                # The statistic along the sharded dimension is complete on this rank.
                mine = local(state["r"] if dim == 0 else state["c"])
                mine.mul_(beta2).add_(g2.mean(1 - dim), alpha=1 - beta2)
                partial += [g2.sum(dim), mine.sum().reshape(1) if dim == 0 else g2.new_zeros(1)]
            sums = torch.cat(partial)
            dist.all_reduce(sums, group=process_group)
            updates: list[torch.Tensor] = []
            squares: list[torch.Tensor] = []
            offset = 0
            for p in members:
                g, dim = local_grad(p), sharded_layout(p).dim
                state = self.state_of(p)
                r, c = local(state["r"]), local(state["c"])
                n = p.shape[1 - dim]
                other = r if dim == 1 else c
                other.mul_(beta2).add_(sums[offset:offset + n] / p.shape[dim], alpha=1 - beta2)
                r_mean = sums[offset + n] / p.shape[0] if dim == 0 else r.mean()
                offset += n + 1
                u = g / _root_second_moment(r, c, r_mean, eps).to(g.dtype)
                updates.append(u)
                squares.append(u.float().pow(2).sum())
            totals = torch.stack(squares)
            dist.all_reduce(totals, group=process_group)
            for p, u, square in zip(members, updates, totals, strict=True):
                _apply(local(p), u, (square / p.numel()).sqrt().to(u.dtype), group)


def _root_second_moment(r: torch.Tensor, c: torch.Tensor, r_mean: torch.Tensor, eps: float) -> torch.Tensor:
    """sqrt(v), v = r c^T / max(mean(r), eps): the factored second moment (of this rank's block)."""
    return (r[:, None] * c[None, :] / r_mean.clamp(min=eps)).sqrt()


def _apply(w: torch.Tensor, u: torch.Tensor, rms: torch.Tensor, group: dict[str, Any]) -> None:
    """Clip u to RMS `clip`, decay, step."""
    # clip / rms is computed as clip * (1 / rms): bitwise the reference's for the default clip
    # 1.0, within one float32 rounding for other clips.
    u = u * (group["clip"] / rms).clamp(max=1.0)
    if group["wd"] > 0:
        w.mul_(1 - group["lr"] * group["wd"])
    w.add_(u, alpha=-group["lr"])
