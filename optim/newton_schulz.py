"""Quintic Newton-Schulz iteration: an approximate polar factor U V^T of a matrix U S V^T.

Source: Keller Jordan, "Muon: An optimizer for hidden layers in neural networks" (2024),
https://kellerjordan.github.io/posts/muon/. The coefficients (3.4445, -4.7750, 2.0315) maximise
the slope at zero instead of converging: five steps map every singular value into roughly
[0.7, 1.2] rather than onto 1, which the post found does not hurt training and saves steps.

Contracts:
- `newton_schulz(G)` takes one matrix (rows, cols) or a stack (n, rows, cols) and computes the
  reference's arithmetic (`G / (||G||_F + eps)`, then `A = X X^T; B = bA + cA^2; X = aX + BX` on
  the wide orientation) with the same roundings. For one float32 matrix the result is bitwise
  the reference's.
- `ns_batches(params)` + `orthogonalize(batch)` are what Muon and OLion call: same-shape
  matrices go through one `bmm` chain where that is faster (see `_BATCH_ON_CPU_MAX_NUMEL`),
  others one by one. A batched result equals the per-matrix result within floating-point
  tolerance (bitwise on CPU in our tests), in the input dtype and order.
- `require_matrices(optimizer, group)` is the 2D-only contract shared by Muon, OLion and
  Adafactor2D: a non-2D parameter is a `ValueError` that names the parameter.
"""

from collections import defaultdict

import torch

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7
NS_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

# On CPU (one thread) a stacked bmm wins for small matrices and loses for large ones: measured
# batch/loop time 0.33 at 32x32, 0.88 at 96x96, 1.13 at 128x128, 1.40 at 256x256. On
# accelerators the batch removes per-matrix kernel launches, which dominate for the matrix sizes
# of small GPTs.
_BATCH_ON_CPU_MAX_NUMEL = 12288


def newton_schulz(
    G: torch.Tensor, steps: int = 5, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Approximate polar factor of `G` (rows, cols) or of each matrix of `G` (n, rows, cols).

    Runs in `dtype` (float32, or bfloat16 for tensor-core speed at ~1e-2 relative precision) and
    returns that dtype; the caller casts back.
    """
    a, b, c = NS_COEFFICIENTS
    G = G.to(dtype)
    # A 2D norm() and a norm over the last two dims reduce the same elements in the same order;
    # the 2D form keeps the single-matrix path literally the reference's.
    norm = G.norm() if G.ndim == 2 else G.norm(dim=(-2, -1), keepdim=True)
    X = G / (norm + NS_EPS)
    # Iterate on the wide orientation so the Gram matrix X X^T is the small one.
    transposed = X.size(-2) > X.size(-1)
    if transposed:
        X = X.mT
    for _ in range(steps):
        # The reference's B = b*A + c*A^2 and X = a*X + B X, with every product and sum rounded
        # as there (no fused multiply-add), but in place: ~20% faster on CPU, bitwise the same.
        A = X @ X.mT
        B = A @ A
        B.mul_(c).add_(A.mul_(b))
        X = (B @ X).add_(X.mul_(a))
    return X.mT if transposed else X


def _batch_is_faster(shape: torch.Size, device: torch.device) -> bool:
    return device.type != "cpu" or shape.numel() <= _BATCH_ON_CPU_MAX_NUMEL


def ns_batches(params: list[torch.Tensor], batched: bool | None = None) -> list[list[torch.Tensor]]:
    """`params` split into the batches `orthogonalize` should take, in first-appearance order.

    `batched`: True puts every same (shape, device, dtype) group in one batch, False makes one
    batch per matrix, None (default) batches a group where `_batch_is_faster`. Callers compute a
    batch's updates just before orthogonalising it, so the transient memory is one batch, not
    every matrix at once.
    """
    groups: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    for p in params:
        groups[(p.shape, p.device, p.dtype)].append(p)
    out = []
    for (shape, device, _), group in groups.items():
        if batched if batched is not None else _batch_is_faster(shape, device):
            out.append(group)
        else:
            out.extend([p] for p in group)
    return out


def orthogonalize(
    matrices: list[torch.Tensor], steps: int = 5, dtype: torch.dtype = torch.float32
) -> list[torch.Tensor]:
    """`newton_schulz` of each matrix (all of one shape), in order and in its own dtype: one
    call on the stack when there are several (one bmm chain instead of a loop of mm)."""
    if len(matrices) == 1:
        return [newton_schulz(matrices[0], steps, dtype).to(matrices[0].dtype)]
    stacked = newton_schulz(torch.stack(matrices), steps, dtype)
    return [q.to(m.dtype) for m, q in zip(matrices, stacked.unbind(0))]


def require_matrices(optimizer: torch.optim.Optimizer, group: dict) -> None:
    """Raise `ValueError` naming the first non-2D parameter of `group` (a 2D-only optimizer's
    `add_param_group` calls this). Names come from torch's named-parameter groups
    (`param_names`); unnamed groups name the parameter by its position."""
    names = group.get("param_names") or [f"params[{i}]" for i in range(len(group["params"]))]
    for name, p in zip(names, group["params"]):
        if p.ndim != 2:
            raise ValueError(
                f"{type(optimizer).__name__} only takes 2D parameters, but {name!r} has shape "
                f"{tuple(p.shape)}; route it to AdamW (see optim.build matrix_patterns)"
            )
