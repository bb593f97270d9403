"""Muon: momentum SGD whose update is orthogonalised by Newton-Schulz, for 2D hidden matrices.

Sources: Keller Jordan, "Muon: An optimizer for hidden layers in neural networks" (2024),
https://kellerjordan.github.io/posts/muon/ (update rule, `sqrt(max(1, rows/cols))` scaling);
Liu et al., "Muon is Scalable for LLM Training" (Moonlight, arXiv:2502.16982) for the
`consistent_rms * sqrt(max(rows, cols))` scaling and decoupled weight decay.

Update, per 2D parameter p with gradient g (the team's reference rule):
    buf <- momentum * buf + g
    u   <- g + momentum * buf   (nesterov)   or   buf
    O   <- NewtonSchulz(u)                     (optim.newton_schulz, in `ns_dtype`)
    p   <- p * (1 - lr * weight_decay)         (only when weight_decay > 0)
    p   <- p - lr * scale * O,  scale = sqrt(max(1, rows/cols))           if consistent_rms is None
                                        consistent_rms * sqrt(max(rows, cols))  otherwise

For float32 parameters, with float32 NS, no weight decay and the per-matrix path this is bitwise
the reference. For bfloat16 parameters it is not: the reference runs NS in the parameter dtype
(bfloat16), Muon here in `ns_dtype` whatever the parameter dtype (float32 by default: fewer
roundings), then casts the result to the parameter dtype. With `ns_dtype="bfloat16"` the NS
result is bitwise the reference's, and so is the update of wide and square matrices; for tall
ones the result is a transposed view and the final bfloat16 `add_` can round one unit in the
last place differently (tests/optim/test_muon.py). It equals
`torch.optim.Muon(adjust_lr_fn="original", weight_decay=0)` up to NS precision: torch keeps an
EMA buffer (a (1 - momentum) multiple of ours), which the NS normalisation cancels.
Only 2D parameters are accepted (the reference's non-2D fallback is AdamW's job in optim.build).
"""

import torch

from optim.closure import run_closure
from optim.newton_schulz import NS_DTYPES, ns_batches, orthogonalize, require_matrices


class Muon(torch.optim.Optimizer):
    """Muon over 2D parameters. State per parameter: `mom` (momentum buffer, shape of p).

    Args: lr (0.02), momentum (0.95), ns_steps (5), nesterov (True), consistent_rms (None: the
    reference's shape scaling; 0.2: Moonlight's AdamW-matched RMS), ns_dtype ("float32" or
    "bfloat16"), weight_decay (0.0, decoupled), ns_batched (None: stack same-shape matrices when
    faster; True/False force it; results agree within float tolerance).
    Raises ValueError for a non-2D parameter (named) or an unknown ns_dtype.
    """

    def __init__(
        self,
        params,
        lr: float = 0.02,
        momentum: float = 0.95,
        ns_steps: int = 5,
        nesterov: bool = True,
        consistent_rms: float | None = None,
        ns_dtype: str = "float32",
        weight_decay: float = 0.0,
        ns_batched: bool | None = None,
    ):
        if ns_dtype not in NS_DTYPES:
            raise ValueError(f"ns_dtype must be one of {sorted(NS_DTYPES)}, got {ns_dtype!r}")
        defaults = dict(
            lr=lr,
            momentum=momentum,
            ns_steps=ns_steps,
            nesterov=nesterov,
            consistent_rms=consistent_rms,
            ns_dtype=ns_dtype,
            weight_decay=weight_decay,
            ns_batched=ns_batched,
        )
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        require_matrices(self, self.param_groups[-1])

    @staticmethod
    def state_shapes(p: torch.Tensor) -> dict[str, tuple[int, ...]]:
        """The state kept per parameter once it has stepped (the bundle checks loads against it)."""
        return {"mom": tuple(p.shape)}

    @staticmethod
    def update_scale(shape: torch.Size, consistent_rms: float | None) -> float:
        """The factor on the orthogonalised update for a (rows, cols) parameter."""
        rows, cols = shape
        if consistent_rms is None:
            return max(1.0, rows / cols) ** 0.5
        return consistent_rms * max(rows, cols) ** 0.5

    @torch.no_grad()
    def step(self, closure=None):
        loss = run_closure(closure)
        for group in self.param_groups:
            momentum, lr, wd = group["momentum"], group["lr"], group["weight_decay"]
            params = [p for p in group["params"] if p.grad is not None]
            for batch in ns_batches(params, group["ns_batched"]):
                updates = []
                for p in batch:
                    g = p.grad
                    state = self.state[p]
                    if "mom" not in state:
                        state["mom"] = torch.zeros_like(g)
                    buf = state["mom"]
                    buf.mul_(momentum).add_(g)
                    updates.append(g.add(buf, alpha=momentum) if group["nesterov"] else buf)
                ortho = orthogonalize(updates, group["ns_steps"], NS_DTYPES[group["ns_dtype"]])
                for p, o in zip(batch, ortho):
                    if wd > 0:
                        p.mul_(1 - lr * wd)
                    scale = self.update_scale(p.shape, group["consistent_rms"])
                    # x * 1.0 == x exactly: skipping it saves a pass over wide and square matrices.
                    p.add_(o if scale == 1.0 else o * scale, alpha=-lr)
        return loss
