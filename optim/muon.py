"""Muon: momentum SGD whose update is orthogonalised by Newton-Schulz, for 2D hidden matrices.

Sources: Keller Jordan, "Muon: An optimizer for hidden layers in neural networks" (2024),
https://kellerjordan.github.io/posts/muon/ (update rule, `sqrt(max(1, rows/cols))` scaling);
Liu et al., "Muon is Scalable for LLM Training" (Moonlight, arXiv:2502.16982) for the
`consistent_rms * sqrt(max(rows, cols))` scaling and decoupled weight decay.

Update, per 2D parameter p with gradient g (the team's reference rule):
    buf <- momentum * buf + g
    u   <- g + momentum * buf   (nesterov)   or   buf
    O   <- NewtonSchulz(u)                     (optim.newton_schulz, in `ns_dtype`: "auto" =
                                                bfloat16 on CUDA, float32 elsewhere)
    p   <- p * (1 - lr * weight_decay)         (only when weight_decay > 0)
    p   <- p - lr * scale * O,  scale = sqrt(max(1, rows/cols))           if consistent_rms is None
                                        consistent_rms * sqrt(max(rows, cols))  otherwise

With float32 NS (the default on CPU) and no weight decay this is bitwise the reference on CPU for
float32 parameters, batched or not (tests/optim/test_muon.py). For bfloat16 parameters it is
not: the reference runs NS in the parameter dtype (bfloat16), Muon here in `ns_dtype` whatever
the parameter dtype (float32 on CPU by default: fewer roundings), then casts the result to the
parameter dtype. With `ns_dtype="bfloat16"` the two sums of each NS iteration are fused into the
products (`addmm`, as torch.optim.Muon does), so the result agrees with the reference's bfloat16
NS to bfloat16 precision, not bitwise. It equals `torch.optim.Muon(adjust_lr_fn="original",
weight_decay=0)` up to NS precision: torch keeps an EMA buffer (a (1 - momentum) multiple of
ours), which the NS normalisation cancels, and runs NS in bfloat16 on every device.

Speed (docs/bench-optim.md): the elementwise parts are foreach ops over a batch (one kernel
per op on accelerators; on CPU the same per-tensor ops, hence the same roundings), and
same-shape matrices, transposed pairs included, share one batched Newton-Schulz where that is
faster (optim.newton_schulz.ns_batches).
Only 2D parameters are accepted (the reference's non-2D fallback is AdamW's job in optim.build).

Sharded parameters (DTensors, FSDP2): the momentum and the update run on local shards; each whole
update matrix is orthogonalised once, on one rank, and its shards sent back (optim.sharded), so
the result is the one-process step's, bitwise on a CPU in float32 (tests/optim/test_sharded.py).
"""

from collections.abc import Callable
from typing import overload

import torch
from torch.optim.optimizer import ParamsT

from optim.base import MatrixOptimizer
from optim.closure import run_closure
from optim.dtensor import local, local_grad
from optim.newton_schulz import NS_DTYPE_CHOICES, ns_dtype
from optim.sharded import matrix_rounds, orthogonalize_matrices


class Muon(MatrixOptimizer):
    """Muon over 2D parameters. State per parameter: `mom` (momentum buffer, shape of p).

    Args: lr (0.02), momentum (0.95), ns_steps (5), nesterov (True), consistent_rms (None: the
    reference's shape scaling; 0.2: Moonlight's AdamW-matched RMS), ns_dtype ("auto": bfloat16
    on CUDA, float32 elsewhere; or "float32" / "bfloat16" everywhere), weight_decay (0.0,
    decoupled), ns_batched (None: stack same-shape matrices when faster; True/False force it;
    results agree within float tolerance, bitwise in float32 on CPU).
    Raises ValueError for a non-2D parameter (named) or an unknown ns_dtype.
    """

    STATE = ("mom",)

    def __init__(
        self,
        params: ParamsT,
        lr: float = 0.02,
        momentum: float = 0.95,
        ns_steps: int = 5,
        nesterov: bool = True,
        consistent_rms: float | None = None,
        ns_dtype: str = "auto",
        weight_decay: float = 0.0,
        ns_batched: bool | None = None,
    ):
        if ns_dtype not in NS_DTYPE_CHOICES:
            raise ValueError(f"ns_dtype must be one of {list(NS_DTYPE_CHOICES)}, got {ns_dtype!r}")
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

    @staticmethod
    def update_scale(shape: torch.Size, consistent_rms: float | None) -> float:
        """The factor on the orthogonalised update for a (rows, cols) parameter."""
        rows, cols = shape
        if consistent_rms is None:
            return float(max(1.0, rows / cols) ** 0.5)  # float ** float is typed Any (complex for a base < 0)
        return float(consistent_rms * max(rows, cols) ** 0.5)

    @overload
    def step(self, closure: None = None) -> None: ...
    @overload
    def step(self, closure: Callable[[], float]) -> float: ...
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = run_closure(closure)
        for group in self.param_groups:
            momentum, lr, wd = group["momentum"], group["lr"], group["weight_decay"]
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            dtype = ns_dtype(group["ns_dtype"], params[0].device)
            for batch in matrix_rounds(params, group["ns_batched"], dtype):
                grads = [local_grad(p) for p in batch]
                bufs = [local(self.state_of(p)["mom"]) for p in batch]
                torch._foreach_mul_(bufs, momentum)
                torch._foreach_add_(bufs, grads)
                updates = torch._foreach_add(grads, bufs, alpha=momentum) if group["nesterov"] else bufs
                ortho = orthogonalize_matrices(batch, updates, group["ns_steps"], dtype, group["ns_batched"])
                del updates  # the transient memory of a step is one batch
                weights = [local(p) for p in batch]
                if wd > 0:
                    torch._foreach_mul_(weights, 1 - lr * wd)
                # x * 1.0 == x exactly: skipping it saves a pass over wide and square matrices.
                scaled = [(o, s) for o, s in zip(ortho, (self.update_scale(p.shape, group["consistent_rms"])
                                                         for p in batch), strict=True) if s != 1.0]
                if scaled:
                    torch._foreach_mul_([o for o, _ in scaled], [s for _, s in scaled])
                torch._foreach_add_(weights, ortho, alpha=-lr)
        return loss
