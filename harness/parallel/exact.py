"""The canonical gradient sum of `parallel.exact_elastic`: one summation tree over a step's V
micro-batch gradients, the same at every world size, so a run resumed on another number of
ranks (or reproduced on one process) ends bit for bit where the uninterrupted run ends.

The tree is the binary counter over the leaves 0..V-1 (`SumTree`): pushing leaf v merges the
two newest partial sums while they cover equally many leaves (left + right), and the stack left
at the end is folded from the newest (smallest) sum to the oldest. Float addition is commutative
but not associative, so the tree, not the order of operands, decides the bits. A partial sum of
an aligned power-of-two block of leaves is a subtree: pushing it as one item gives the same tree
as pushing its leaves. So a rank whose block (V / W leaves from r*V/W) is such a subtree sums it
on its own, and the W ranks' block sums, pushed in rank order, finish the same tree: that is why
the exact world sizes are 1 and the W with V / W a power of two (config.exact_world_sizes).

Across ranks (`reduce_blocks`) the sum is a reduce-scatter done by hand, then an all-gather: an
all-to-all sends shard j of every rank's block sum to rank j, which pushes the W shards it holds
in rank order through a `SumTree` (elementwise, so a shard of the tree's result is the tree over
the shards), and an all-gather gives every rank the whole sum. Each rank sends and receives
2 (W - 1) / W of the gradient bytes: what a ring all-reduce moves. DDP's own all-reduce is not
used: its buckets sum in the ring's order, which depends on W.

Every gradient is one flat float32 vector per micro-batch (`flat_gradients`): the parameters'
gradients in `model.parameters()` order, zeros for a parameter that got none (so every leaf has
the same layout at every world size), with which parameters got one. `set_gradients` puts the
summed vector back as the parameters' `.grad`, in their dtypes, and leaves `.grad` None for a
parameter no micro-batch of the step gave a gradient on any rank (`used_anywhere`): what one
process accumulating, or DDP, leaves, so an optimizer skips it (AdamW applies no weight decay
and no momentum to it) in this mode as in the default one. Under FSDP the leaves are the same
whole gradients, and the cross-rank sum ends in FSDP's shards instead
(harness/parallel/exact_fsdp.py).

The other reductions of a step are made order-free too: `clip_gradients` (the clipping norm
from exactly summed per-row sums of squares) and `mean_over_micro_batches` (the logged loss).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist

from optim.dtensor import local_grad


class SumTree:
    """The binary-counter summation tree over leaves pushed in order (module docstring). Equal
    aligned power-of-two block sums pushed into a fresh tree combine as their leaves would.
    Merges add in place into the older partial sum; `result()` is the fold of what is left."""

    def __init__(self) -> None:
        self._stack: list[tuple[int, torch.Tensor]] = []  # (leaves covered, partial sum), oldest first

    def push(self, tensor: torch.Tensor) -> None:
        size = 1
        while self._stack and self._stack[-1][0] == size:
            covered, older = self._stack.pop()
            tensor = older.add_(tensor)
            size += covered
        self._stack.append((size, tensor))

    def result(self) -> torch.Tensor:
        """The sum of every leaf pushed; raises ValueError when none was."""
        if not self._stack:
            raise ValueError("SumTree.result() of no leaves")
        total = self._stack[-1][1]
        for _, older in reversed(self._stack[:-1]):
            total = older.add_(total)
        self._stack = []
        return total


def flat_gradients(params: list[torch.nn.Parameter], used: torch.Tensor,
                   take: Callable[[torch.nn.Parameter], torch.Tensor | None] | None = None) -> torch.Tensor:
    """This micro-batch's whole gradients of `params` as one float32 vector (zeros where a
    parameter has none), cleared for the next micro-batch's backward; `used` (a bool per
    parameter, kept over a step's micro-batches) is set where a parameter had one. `take(p)`
    returns and clears one parameter's whole gradient (FSDP keeps it apart:
    exact_fsdp.FSDPGradients); default: its `.grad`."""
    grads = [take(p) if take is not None else _take_grad(p) for p in params]
    used |= torch.tensor([g is not None for g in grads], dtype=torch.bool)
    return torch.cat([(g if g is not None else torch.zeros(p.shape, device=p.device)).reshape(-1).float()
                      for p, g in zip(params, grads, strict=True)])


def used_anywhere(used: torch.Tensor, world_size: int, device: torch.device) -> torch.Tensor:
    """Which parameters any rank's micro-batches gave a gradient (`used`: this rank's, a bool
    per parameter, the OR over its micro-batches). Collective (one all-reduce of a byte per
    parameter, on `device`: NCCL reduces on the GPU); the identity at world size 1."""
    if world_size == 1:
        return used
    flags = used.to(device=device, dtype=torch.uint8)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return flags.bool().cpu()


def _take_grad(p: torch.nn.Parameter) -> torch.Tensor | None:
    grad, p.grad = p.grad, None
    return grad


def set_gradients(params: list[torch.nn.Parameter], flat: torch.Tensor, used: torch.Tensor) -> None:
    """Give every parameter `used` (`used_anywhere`) its slice of the summed vector `flat` as its
    gradient; every other one none."""
    for p, g, has in zip(params, flat.split([p.numel() for p in params]), used.tolist(), strict=True):
        p.grad = g.view_as(p).to(p.dtype) if has else None


def reduce_blocks(block_sum: torch.Tensor, world_size: int) -> torch.Tensor:
    """Every rank's `block_sum` (its block of the tree, the same length on every rank) summed in
    the tree's order, whole, on every rank (module docstring). Collective; the identity at world
    size 1."""
    if world_size == 1:
        return block_sum
    n = block_sum.numel()
    shard = math.ceil(n / world_size)
    padded = torch.nn.functional.pad(block_sum, (0, shard * world_size - n))
    received = torch.empty_like(padded)
    dist.all_to_all_single(received, padded)  # row r of `received`: rank r's copy of this rank's shard
    tree = SumTree()
    for part in received.view(world_size, shard):  # every rank's block sum is one subtree of A leaves
        tree.push(part)
    whole = torch.empty_like(padded)
    dist.all_gather(list(whole.view(world_size, shard)), tree.result())
    return whole[:n]


def clip_gradients(params: list[torch.nn.Parameter], max_norm: float, world_size: int, *, device: torch.device,
                   sharded: bool) -> float:
    """The global norm of the summed gradients, in an order no sharding changes, then every
    gradient scaled by min(1, max_norm / (norm + 1e-6)) as torch's clip_grad_norm_ does. Each
    gradient row's sum of squares is taken in float64 (a square of a float32 is exact there)
    left to right (a cumulative sum: one order whatever the thread count or the number of rows
    beside it); the rows of every rank (FSDP: each its own shards' rows, all-gathered) are
    added exactly rounded (math.fsum), so the norm depends on the gradient values alone.
    Collective when `sharded` (the gradients are FSDP's shards: the same on every rank, so every
    rank gathers, one without gradients too), on `device`, the rank's training device (NCCL
    gathers only GPU tensors)."""
    rows = [_row_squares(local_grad(p)) for p in params]
    values = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.float64, device=device)
    if world_size > 1 and sharded:
        # No rank holds more rows than all: the bound is the same on every rank holding the same parameters.
        bound = sum((p.shape[0] if p.dim() else 1) for p in params)
        padded = torch.nn.functional.pad(values, (0, bound - values.numel()))  # zeros add nothing to the sum
        gathered = [torch.empty_like(padded) for _ in range(world_size)]
        dist.all_gather(gathered, padded)
        values = torch.cat(gathered)
    norm = math.sqrt(math.fsum(values.tolist()))
    coef = max_norm / (norm + 1e-6)
    if coef < 1.0:
        for p in params:
            local_grad(p).mul_(coef)
    return norm


def _row_squares(g: torch.Tensor) -> torch.Tensor:
    if not g.numel():  # an empty shard
        return torch.zeros(0, dtype=torch.float64, device=g.device)
    return g.reshape(g.shape[0] if g.dim() else 1, -1).double().square().cumsum(dim=1)[:, -1]


def mean_over_micro_batches(losses: torch.Tensor, world_size: int) -> float:
    """The mean of every rank's micro-batch losses (`losses`: this rank's, in its block's order),
    exactly rounded (math.fsum), so it does not depend on how the micro-batches were split."""
    values = losses.detach().double()
    if world_size > 1:
        gathered = [torch.empty_like(values) for _ in range(world_size)]
        dist.all_gather(gathered, values)  # on the losses' device: NCCL gathers on the GPU
        values = torch.cat(gathered)
    return math.fsum(values.tolist()) / values.numel()
