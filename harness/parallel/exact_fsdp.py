"""Exact elastic mode under FSDP2 (`parallel.strategy = "fsdp"`): where a micro-batch's whole
gradient lies, and how the tree's sum is cut into FSDP's row shards.

FSDP's own reduce-scatter sums in the ring's order, so exact mode switches it off for every
micro-batch (`set_requires_gradient_sync(False)`): each parameter's whole, unreduced gradient
then stays on FSDP's unsharded parameter (`FSDPParam._unsharded_param.grad`, or its
`unsharded_accumulated_grad` where a reduce dtype differs from the compute dtype), which
`FSDPGradients.take` reads and clears after each micro-batch's backward. These are FSDP2's
internal names (torch 2.13); a torch that renames them fails here loudly, not silently.

`ShardLayout` is FSDP's cut (torch.chunk along dim 0: rank j holds rows j*c .. (j+1)*c - 1 of a
parameter of R rows, c = ceil(R / W), the last ranks fewer or none): the flat block sum is laid
out as W rows of every parameter's padded chunk, the all-to-all sends row j to rank j, and each
rank's tree sum of what it received is its own shards, set as the DTensor gradients FSDP would
have produced. The same bytes on the wire as FSDP's reduce-scatter; no all-gather follows.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from harness.parallel.exact import SumTree
from optim.dtensor import is_dtensor


class FSDPGradients:
    """Each sharded parameter's whole gradient of the last backward (module docstring)."""

    def __init__(self, model: torch.nn.Module) -> None:
        from torch.distributed.fsdp import FSDPModule

        self._fsdp_params = {}
        for module in model.modules():
            if isinstance(module, FSDPModule):
                for group in module._get_fsdp_state()._fsdp_param_groups:
                    for fsdp_param in group.fsdp_params:
                        self._fsdp_params[id(fsdp_param.sharded_param)] = fsdp_param

    def take(self, p: torch.nn.Parameter) -> torch.Tensor | None:
        """The whole gradient of parameter `p` (a DTensor) from the last backward, or None; cleared."""
        fsdp_param = self._fsdp_params[id(p)]
        grad = fsdp_param.unsharded_accumulated_grad
        fsdp_param.unsharded_accumulated_grad = None
        unsharded = fsdp_param._unsharded_param
        if grad is None:
            grad = unsharded.grad
        unsharded.grad = None
        return grad


class ShardLayout:
    """FSDP's row shards of `params` (DTensors, Shard(0) on a 1-D mesh) over `world` ranks."""

    def __init__(self, params: list[torch.nn.Parameter], world: int, rank: int) -> None:
        self.world, self.rank = world, rank
        self.params = params
        self.rows = [p.shape[0] if p.dim() else 1 for p in params]
        self.row_size = [p.numel() // r if r else 0 for p, r in zip(params, self.rows, strict=True)]
        self.chunk = [math.ceil(r / world) for r in self.rows]  # rows per rank, as torch.chunk cuts them

    def scatter(self, block_sum: torch.Tensor) -> torch.Tensor:
        """[world, S]: row j holds rank j's padded chunk of every parameter of the flat `block_sum`."""
        pieces, offset = [], 0
        for rows, size, chunk in zip(self.rows, self.row_size, self.chunk, strict=True):
            g = block_sum[offset:offset + rows * size].view(rows, size)
            offset += rows * size
            padded = torch.nn.functional.pad(g, (0, 0, 0, chunk * self.world - rows))
            pieces.append(padded.view(self.world, chunk * size))
        return torch.cat(pieces, dim=1)

    def set_local_gradients(self, mine: torch.Tensor, used: torch.Tensor) -> None:
        """Give every parameter `used` (exact.used_anywhere) its shard of this rank's summed
        chunks `mine` as a DTensor gradient; every other one none."""
        from torch.distributed.tensor import DTensor

        offset = 0
        for p, rows, size, chunk, has in zip(self.params, self.rows, self.row_size, self.chunk, used.tolist(),
                                             strict=True):
            part = mine[offset:offset + chunk * size].view(chunk, size)
            offset += chunk * size
            if not has:
                p.grad = None
                continue
            local_rows = max(0, min(rows, (self.rank + 1) * chunk) - self.rank * chunk)
            local = part[:local_rows].reshape(local_rows, *p.shape[1:]).to(p.dtype)
            assert is_dtensor(p)  # fully_shard made every parameter a DTensor
            p.grad = DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())


def reduce_scatter_blocks(block_sum: torch.Tensor, layout: ShardLayout, used: torch.Tensor) -> None:
    """Every rank's flat `block_sum` summed in the tree's order, this rank keeping its shards as
    the gradients of its parameters `used` (exact.used_anywhere) (module docstring). Collective."""
    send = layout.scatter(block_sum)
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send)  # row r of `received`: rank r's copy of this rank's chunks
    tree = SumTree()
    for part in received:
        tree.push(part)
    layout.set_local_gradients(tree.result(), used)
