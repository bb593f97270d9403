"""Quintic Newton-Schulz iteration: an approximate polar factor U V^T of a matrix U S V^T.

Source: Keller Jordan, "Muon: An optimizer for hidden layers in neural networks" (2024),
https://kellerjordan.github.io/posts/muon/. The coefficients (3.4445, -4.7750, 2.0315) maximise
the slope at zero instead of converging: five steps map every singular value into roughly
[0.7, 1.2] rather than onto 1, which the post found does not hurt training and saves steps.

Contracts:
- `newton_schulz(G)` takes one matrix (rows, cols) or a stack (n, rows, cols). In float32 it
  computes the reference's arithmetic (`G / (||G||_F + eps)`, then `A = X X^T; B = bA + cA^2;
  X = aX + BX` on the wide orientation) with the same roundings: for one float32 matrix the
  result is bitwise the reference's. In bfloat16 (`NS_DTYPES`) the two sums are fused into the
  products (`addmm`, as torch.optim.Muon and modded-nanogpt do): one kernel instead of three per
  sum, and rounding differences far below bfloat16's own precision; on a CPU without bfloat16
  instructions each product also takes the operand layout torch's kernel there is fast for.
- `ns_batches(params)` + `orthogonalize(batch)` are what Muon and OLion use (through
  optim.sharded, which adds the sharded-parameter path). A batch holds
  matrices of one *wide* shape: a (4d, d) and a (d, 4d) matrix share one, the tall one transposed
  (the iteration runs on the wide orientation anyway). Each matrix is normalised in its own
  orientation before the stack, so in float32 on the Intel CPUs measured every batched result
  is bitwise the single-matrix result (tested); on an AMD EPYC a tall matrix's could differ in
  the last bits (its slot is contiguous, the single path iterates on its transposed view, and
  MKL there sums by operand layout); on GPUs bmm and mm may sum in other orders (float tolerance).
  A batch's stack is at most `MAX_STACK_BYTES`, which bounds the transient memory of batching.
- `ns_dtype("auto", device)`: bfloat16 on CUDA (tensor cores, as the field runs Muon), float32
  elsewhere: on a CPU float32 is the reference math, and bfloat16 matrix products were slower
  than float32 on the CPUs measured (docs/bench-optim.md).
- `require_matrices(optimizer, group)` is the 2D-only contract shared by Muon, OLion and
  Adafactor2D: a non-2D parameter is a `ValueError` that names the parameter.
"""

import functools
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import torch

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7
NS_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
NS_DTYPE_CHOICES = ("auto", *NS_DTYPES)

# On CPU (one thread) a stacked float32 bmm wins for small matrices and loses for large ones:
# measured batch/loop time 0.33 at 32x32, 0.88 at 96x96, 1.13 at 128x128, 1.40 at 256x256. In
# bfloat16 the stack won at every size measured on an AVX-512 CPU (0.66 at 128x128, 0.96 at
# 256x256, 0.97 at 512x512) and was even with the loop on an AVX2 one (0.83-1.02 up to
# 512x512). On accelerators the batch removes per-matrix kernel launches, which dominate for the
# matrix sizes of small GPTs.
_BATCH_ON_CPU_MAX_NUMEL = 12288
# The transient memory of one batch is a few times its stack (the stack, X X^T and its square,
# the next X): 256 MiB of stack keeps it about 1 GiB, and a batch that large is compute-bound.
MAX_STACK_BYTES = 256 << 20


def ns_dtype(name: str, device: torch.device) -> torch.dtype:
    """The Newton-Schulz dtype `name` (a `NS_DTYPE_CHOICES` entry) means on `device`."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return NS_DTYPES[name]


def _normalized(G: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    G = G.to(dtype)
    # A 2D norm() and a norm over the last two dims reduce the same elements in the same order;
    # the 2D form keeps the single-matrix path literally the reference's. (Tensor.norm is unannotated.)
    norm: torch.Tensor = G.norm() if G.ndim == 2 else G.norm(dim=(-2, -1), keepdim=True)
    return G / (norm + NS_EPS)


def _iterate(X: torch.Tensor, steps: int) -> torch.Tensor:
    """The quintic iteration on a normalised, wide X (or stack of them), in X's dtype."""
    a, b, c = NS_COEFFICIENTS
    if X.dtype != torch.float32:
        return _iterate_fused(X, steps)
    for _ in range(steps):
        # The reference's B = b*A + c*A^2 and X = a*X + B X, with every product and sum rounded
        # as there (no fused multiply-add), but in place: ~20% faster on CPU, bitwise the same.
        # X keeps its layout as the reference's `a * X + ...` does (a tall matrix iterates on its
        # transposed view): oneMKL may sum a product in another order for another operand
        # layout (it did on an AMD EPYC, not on the Intel CPUs measured before).
        A = X @ X.mT
        B = A @ A
        B.mul_(c).add_(A.mul_(b))
        BX = B @ X
        X = X.mul_(a).add_(BX)
    return X


@functools.cache
def _torch_own_bfloat16_products() -> bool:
    """Whether this CPU's bfloat16 matrix products run in torch's own kernel, not oneDNN's: a CPU
    without AVX-512 or bfloat16 instructions (the check torch's matrix product itself makes)."""
    return not torch.ops.mkldnn._is_mkldnn_bf16_supported()


def _iterate_fused(X: torch.Tensor, steps: int) -> torch.Tensor:
    """The quintic iteration with its two sums fused into the products (`addmm`), for bfloat16.

    Where torch's own bfloat16 matrix product runs (`_torch_own_bfloat16_products`), each product
    gets the operand layout that kernel is fast for, a column-major left factor and a row-major
    right one: 6-17x faster per product than two row-major operands on an AVX2 CPU
    (docs/bench-optim.md). A = X X^T and B = bA + cA^2 are symmetric, so their transposed views
    stand in for them as left factors (the same products); the Gram product takes a column-major
    copy of X. On GPUs and oneDNN CPUs the products are the plain ones.
    """
    a, b, c = NS_COEFFICIENTS
    addmm = torch.addmm if X.ndim == 2 else torch.baddbmm
    by_layout = X.device.type == "cpu" and _torch_own_bfloat16_products()
    if by_layout:
        X = X.contiguous()  # a tall matrix arrives as a transposed view: the right factor of B X
    for _ in range(steps):
        left = X.mT.contiguous().mT if by_layout else X
        A = left @ left.mT
        B = addmm(A, A.mT if by_layout else A, A, beta=b, alpha=c)
        X = addmm(X, B.mT if by_layout else B, X, beta=a)
    return X


def _is_tall(shape: torch.Size) -> bool:
    return shape[-2] > shape[-1]


def newton_schulz(
    G: torch.Tensor, steps: int = 5, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Approximate polar factor of `G` (rows, cols) or of each matrix of `G` (n, rows, cols).

    Runs in `dtype` (float32, or bfloat16 for tensor-core speed at ~1e-2 relative precision) and
    returns that dtype; the caller casts back.
    """
    X = _normalized(G, dtype)
    # Iterate on the wide orientation so the Gram matrix X X^T is the small one.
    if _is_tall(X.shape):
        return _iterate(X.mT, steps).mT
    return _iterate(X, steps)


def _wide(shape: torch.Size) -> tuple[int, int]:
    return (shape[1], shape[0]) if _is_tall(shape) else (shape[0], shape[1])


def _batch_is_faster(wide: tuple[int, int], device: torch.device, dtype: torch.dtype) -> bool:
    return device.type != "cpu" or dtype != torch.float32 or wide[0] * wide[1] <= _BATCH_ON_CPU_MAX_NUMEL


def ns_batches(params: list[torch.Tensor], batched: bool | None = None,
               dtype: torch.dtype = torch.float32) -> list[list[torch.Tensor]]:
    """`params` split into the batches `orthogonalize` should take, in first-appearance order.

    `batched`: True puts every same (wide shape, device, dtype) group in batches, False makes one
    batch per matrix, None (default) batches a group where `_batch_is_faster` for Newton-Schulz
    in `dtype`. A batch's stack (in `dtype`) stays within `MAX_STACK_BYTES` (a group larger than
    that is split; one matrix larger than that is a batch of its own). Callers compute a batch's
    updates just before orthogonalising it, so the transient memory is one batch, not every
    matrix at once.
    """
    groups: dict[tuple[tuple[int, int], torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
    for p in params:
        groups[(_wide(p.shape), p.device, p.dtype)].append(p)
    out: list[list[torch.Tensor]] = []
    for (wide, device, _), group in groups.items():
        if not (batched if batched is not None else _batch_is_faster(wide, device, dtype)):
            out.extend([p] for p in group)
            continue
        per_batch = max(1, MAX_STACK_BYTES // (wide[0] * wide[1] * dtype.itemsize))
        out.extend(group[i:i + per_batch] for i in range(0, len(group), per_batch))
    return out


def orthogonalize(
    matrices: Sequence[torch.Tensor], steps: int = 5, dtype: torch.dtype = torch.float32
) -> list[torch.Tensor]:
    """`newton_schulz` of each matrix (all of one wide shape, see `ns_batches`), in order and in
    its own dtype and orientation: one bmm chain on the stack when there are several."""
    if len(matrices) == 1:
        return [newton_schulz(matrices[0], steps, dtype).to(matrices[0].dtype)]
    tall = [_is_tall(m.shape) for m in matrices]
    stack = torch.empty((len(matrices), *_wide(matrices[0].shape)), dtype=dtype, device=matrices[0].device)
    for slot, m, t in zip(stack, matrices, tall, strict=True):
        # Normalised in its own orientation, written straight into its slot: the same values
        # as the single-matrix path, and no second copy of the batch.
        G = m.to(dtype)
        torch.div(G, G.norm() + NS_EPS, out=slot.mT if t else slot)
    out = _iterate(stack, steps).unbind(0)
    return [(q.mT if t else q).to(m.dtype) for m, t, q in zip(matrices, tall, out, strict=True)]


def require_matrices(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> None:
    """Raise `ValueError` naming the first non-2D parameter of `group` (a 2D-only optimizer's
    `add_param_group` calls this). Names come from torch's named-parameter groups
    (`param_names`); unnamed groups name the parameter by its position."""
    names = group.get("param_names") or [f"params[{i}]" for i in range(len(group["params"]))]
    for name, p in zip(names, group["params"], strict=True):
        if p.ndim != 2:
            raise ValueError(
                f"{type(optimizer).__name__} only takes 2D parameters, but {name!r} has shape "
                f"{tuple(p.shape)}; route it to AdamW (see optim.build matrix_patterns)"
            )
