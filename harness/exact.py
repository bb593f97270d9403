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
the same layout at every world size). `set_gradients` puts the summed vector back as the
parameters' `.grad`, in their dtypes.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist


class SumTree:
    """The binary-counter summation tree over leaves pushed in order (module docstring). A leaf
    pushed may itself be the sum of an aligned power-of-two block of `size` leaves. Merges add
    in place into the older partial sum; `result()` is the fold of what is left."""

    def __init__(self) -> None:
        self._stack: list[tuple[int, torch.Tensor]] = []  # (leaves covered, partial sum), oldest first

    def push(self, tensor: torch.Tensor, size: int = 1) -> None:
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


def flat_gradients(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """This micro-batch's gradients of `params` as one float32 vector (zeros where a parameter
    has none); the parameters' `.grad` are cleared for the next micro-batch's backward."""
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float() for p in params])
    for p in params:
        p.grad = None
    return flat


def set_gradients(params: list[torch.nn.Parameter], flat: torch.Tensor) -> None:
    """Give every parameter its slice of the summed vector `flat` as its gradient."""
    for p, g in zip(params, flat.split([p.numel() for p in params])):
        p.grad = g.view_as(p).to(p.dtype)


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


def mean_over_micro_batches(losses: torch.Tensor, world_size: int) -> float:
    """The mean of every rank's micro-batch losses (`losses`: this rank's, in its block's order),
    exactly rounded (math.fsum), so it does not depend on how the micro-batches were split."""
    values = losses.detach().double()
    if world_size > 1:
        gathered = [torch.empty_like(values) for _ in range(world_size)]
        dist.all_gather(gathered, values)  # on the losses' device: NCCL gathers on the GPU
        values = torch.cat(gathered)
    return math.fsum(values.tolist()) / values.numel()
