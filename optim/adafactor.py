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
"""

import torch

from optim.base import MatrixOptimizer
from optim.closure import run_closure


class Adafactor2D(MatrixOptimizer):
    """Adafactor2D over 2D parameters. State per (rows, cols) parameter: `r` (rows,) and
    `c` (cols,), always float32 whatever the parameter dtype.

    Args: lr (1e-3), beta2 (0.999), eps (1e-30), clip (1.0), wd (0.0, decoupled).
    Raises ValueError for a non-2D parameter, naming it.
    """

    def __init__(self, params, lr: float = 1e-3, beta2: float = 0.999, eps: float = 1e-30,
                 clip: float = 1.0, wd: float = 0.0):
        super().__init__(params, dict(lr=lr, beta2=beta2, eps=eps, clip=clip, wd=wd))

    @staticmethod
    def state_shapes(p: torch.Tensor) -> dict[str, tuple[int, ...]]:
        """The state kept per parameter once it has stepped, with its shapes (the bundle checks
        loads against it)."""
        return {"r": (p.shape[0],), "c": (p.shape[1],)}

    def load_state_dict(self, state_dict: dict) -> None:
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

    @torch.no_grad()
    def step(self, closure=None):
        loss = run_closure(closure)
        for group in self.param_groups:
            beta2, eps, lr, wd = group["beta2"], group["eps"], group["lr"], group["wd"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                state = self.state[p]
                if "r" not in state:
                    state["r"] = torch.zeros(g.shape[0], device=g.device, dtype=torch.float32)
                    state["c"] = torch.zeros(g.shape[1], device=g.device, dtype=torch.float32)
                r, c = state["r"], state["c"]
                g2 = g.float().pow(2) + eps
                r.mul_(beta2).add_(g2.mean(1), alpha=1 - beta2)
                c.mul_(beta2).add_(g2.mean(0), alpha=1 - beta2)
                v = r[:, None] * c[None, :] / r.mean().clamp(min=eps)
                u = g / v.sqrt().to(g.dtype)
                rms = u.pow(2).mean().sqrt()
                # clip / rms is computed as clip * (1 / rms): bitwise the reference's for the
                # default clip 1.0, within one float32 rounding for other clips.
                u = u * (group["clip"] / rms).clamp(max=1.0)
                if wd > 0:
                    p.mul_(1 - lr * wd)
                p.add_(u, alpha=-lr)
        return loss
