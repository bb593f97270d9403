"""Quintic Newton-Schulz iteration: an approximate polar factor U V^T of a matrix U S V^T.

Source: Keller Jordan, "Muon: An optimizer for hidden layers in neural networks" (2024),
https://kellerjordan.github.io/posts/muon/. The coefficients (3.4445, -4.7750, 2.0315) maximise
the slope at zero instead of converging: five steps map every singular value into roughly
[0.7, 1.2] rather than onto 1, which the post found does not hurt training and saves steps.

Contracts:
- `newton_schulz(G)` takes one matrix (rows, cols) or a stack (n, rows, cols) and runs the
  reference's ops (`G / (||G||_F + eps)`, then `A = X X^T; B = bA + cA^2; X = aX + BX` on the
  wide orientation). For one float32 matrix the result is bitwise the reference's.
- `orthogonalize(matrices)` is what Muon and OLion call: it stacks matrices of the same shape
  into one `bmm` chain where that is faster (see `_BATCH_ON_CPU_MAX_NUMEL`) and otherwise loops.
  Each result equals the per-matrix result within floating-point tolerance (bitwise on CPU in
  our tests). Results come back in the input dtype, in input order.
- `require_matrices(optimizer, group)` is the 2D-only contract shared by Muon, OLion and
  Adafactor2D: a non-2D parameter is a `ValueError` that names the parameter.
"""

from collections import defaultdict

import torch

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7
NS_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

# On CPU a stacked bmm only wins for small matrices: above ~64x128 the loop of mm is 5-10% faster
# (measured with one thread, see docs/bench-optim.md). On accelerators the batch removes
# per-matrix kernel launches, which dominate for the matrix sizes of small GPTs.
_BATCH_ON_CPU_MAX_NUMEL = 8192


def newton_schulz(G: torch.Tensor, steps: int = 5, dtype: torch.dtype = torch.float32) -> torch.Tensor:
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
        A = X @ X.mT
        B = b * A + c * (A @ A)
        X = a * X + B @ X
    return X.mT if transposed else X


def _batch_is_faster(shape: torch.Size, device: torch.device) -> bool:
    return device.type != "cpu" or shape.numel() <= _BATCH_ON_CPU_MAX_NUMEL


def orthogonalize(
    matrices: list[torch.Tensor],
    steps: int = 5,
    dtype: torch.dtype = torch.float32,
    batched: bool | None = None,
) -> list[torch.Tensor]:
    """`newton_schulz` of each 2D tensor in `matrices`, in order, each in its own dtype.

    `batched`: True stacks every group of two or more same-shape matrices into one call, False
    loops, None (default) batches where `_batch_is_faster`.
    """
    by_shape: dict[tuple, list[int]] = defaultdict(list)
    for i, m in enumerate(matrices):
        by_shape[(m.shape, m.device, m.dtype)].append(i)
    out: list[torch.Tensor | None] = [None] * len(matrices)
    for (shape, device, _), idx in by_shape.items():
        batch = batched if batched is not None else _batch_is_faster(shape, device)
        if batch and len(idx) > 1:
            stacked = newton_schulz(torch.stack([matrices[i] for i in idx]), steps, dtype)
            for i, q in zip(idx, stacked.unbind(0)):
                out[i] = q.to(matrices[i].dtype)
        else:
            for i in idx:
                out[i] = newton_schulz(matrices[i], steps, dtype).to(matrices[i].dtype)
    return out


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
