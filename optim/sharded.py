"""Optimizer math on parameters sharded as DTensors (FSDP2's `fully_shard`): what each rank holds,
and the distributed Newton-Schulz step of Muon and OLion.

Trade-off first. Elementwise rules (Lion, the momentum of Muon and OLion, weight decay, the update
itself) run on each rank's local shard (`local`): the same ops on the same elements, so bitwise
the one-process result, and no communication. Newton-Schulz needs whole matrices. Gathering every
matrix on every rank (a DTensor's `full_tensor()`) would make each rank orthogonalise all of them:
world-size times the compute, and every rank receiving the whole model's updates. Here, as in
Moonlight's distributed Muon (arXiv:2502.16982, section 2.3) and Microsoft's Dion
(github.com/microsoft/dion), each matrix of a round gets one owner rank (round-robin over the
ranks of the shard group); one all-to-all brings every rank's shard of a matrix to its owner, the
owner orthogonalises its matrices (batched as on one process, `ns_batches`), and a second
all-to-all sends every rank its shard of each result. Per rank that is 1/world of the compute and
about 2/world of the model's update bytes, in two collectives per round (`matrix_rounds`) rather
than one or two per matrix. The gathered matrix is bitwise the one-process update, and Newton-Schulz
of it runs the same ops, so Muon and OLion stay bitwise the one-process math on a CPU in float32.

What is supported: a parameter sharded on one dimension of its device mesh (`Shard(0)`, FSDP2's
default, or `Shard(1)`, e.g. from `shard_placement_fn`), replicated on the others (HSDP); chunks as
`torch.chunk` cuts them (uneven ones included). Anything else (`Partial`, two sharded mesh
dimensions, strided shards of tensor parallelism) is refused by `layout_of` with a ValueError that
names the parameter and its placements (Muon, OLion and Adafactor2D check when a group is added;
Lion, elementwise, takes any placement). A DTensor replicated on every mesh dimension is, for the math, a plain tensor
(`local` is the whole of it).

Every rank of a shard group must step the same parameters in the same order (FSDP gives every rank
a gradient for the same parameters), since each round is a collective.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from optim.dtensor import is_dtensor
from optim.newton_schulz import MAX_STACK_BYTES, ns_batches, orthogonalize


def chunk_sizes(n: int, world: int) -> tuple[int, ...]:
    """Each rank's extent of a dimension of size `n` cut into `world` pieces as `torch.chunk`
    (and so DTensor's `Shard`) cuts it: ceil(n / world) each, the last ones shorter or empty."""
    step = -(-n // world)
    return tuple(max(0, min(step, n - k * step)) for k in range(world))


@dataclass(frozen=True)
class ShardLayout:
    """How one sharded parameter is cut: along tensor dimension `dim`, over the ranks of `group`
    (a mesh dimension's process group), rank k holding `sizes[k]` of it; this rank is `rank`."""

    group: dist.ProcessGroup
    rank: int
    dim: int
    sizes: tuple[int, ...]

    @property
    def world(self) -> int:
        return len(self.sizes)

    def offset(self, k: int) -> int:
        return sum(self.sizes[:k])

    def piece_shape(self, shape: tuple[int, ...], k: int) -> tuple[int, ...]:
        return tuple(self.sizes[k] if d == self.dim else n for d, n in enumerate(shape))

    def piece_numel(self, shape: tuple[int, ...], k: int) -> int:
        return int(torch.Size(self.piece_shape(shape, k)).numel())


def layout_of(p: torch.Tensor, name: str = "a parameter") -> ShardLayout | None:
    """The layout of a sharded DTensor `p`; None for a plain tensor or a fully replicated DTensor.
    Raises ValueError, naming `name`, for placements Newton-Schulz and Adafactor's statistics
    cannot take (module docstring)."""
    if not is_dtensor(p):
        return None
    from torch.distributed.tensor import Replicate, Shard  # loaded already: `p` is a DTensor (optim/dtensor.py)

    sharded = [(mesh_dim, pl) for mesh_dim, pl in enumerate(p.placements) if not isinstance(pl, Replicate)]
    if not sharded:
        return None
    mesh_dim, placement = sharded[0]
    if len(sharded) > 1 or type(placement) is not Shard:
        raise ValueError(f"{name} of shape {tuple(p.shape)} has placements {p.placements}; the matrix "
                         "optimizers in optim take parameters sharded on one mesh dimension (Shard(d), "
                         "as FSDP2's fully_shard makes them) and replicated on the others; route it to "
                         "AdamW or Lion (see optim.build matrix_patterns)")
    mesh = p.device_mesh
    layout = ShardLayout(mesh.get_group(mesh_dim), mesh.get_local_rank(mesh_dim), placement.dim,
                         chunk_sizes(p.shape[placement.dim], mesh.size(mesh_dim)))
    if p.to_local().shape[layout.dim] != layout.sizes[layout.rank]:
        raise ValueError(f"{name} of shape {tuple(p.shape)} has a local shard of shape "
                         f"{tuple(p.to_local().shape)}, not torch.chunk's cut {layout.sizes}: an "
                         "unsupported sharding")
    return layout


def sharded_layout(p: torch.Tensor) -> ShardLayout:
    """`layout_of(p)` of a parameter its caller has found sharded."""
    layout = layout_of(p)
    if layout is None:
        raise ValueError("a plain or replicated parameter reached the sharded path")
    return layout


def factor_zeros(p: torch.Tensor, dim: int) -> torch.Tensor:
    """float32 zeros of length `p.shape[dim]` (a row or column statistic of a matrix), placed as
    that dimension of `p` is: sharded where `p` is sharded along `dim`, replicated elsewhere."""
    if not is_dtensor(p):
        return torch.zeros(p.shape[dim], device=p.device, dtype=torch.float32)
    from torch.distributed.tensor import Replicate, Shard, zeros as dtensor_zeros  # loaded: `p` is a DTensor

    placements = [Shard(0) if isinstance(pl, Shard) and pl.dim == dim else Replicate() for pl in p.placements]
    return dtensor_zeros(p.shape[dim], device_mesh=p.device_mesh, placements=placements, dtype=torch.float32)


def matrix_rounds(params: list[torch.Tensor], batched: bool | None,
                  dtype: torch.dtype) -> list[list[torch.Tensor]]:
    """`params` split into the lists `orthogonalize_matrices` takes: plain (and fully replicated)
    matrices in `ns_batches`' batches; sharded ones, per shard group and dtype, in the order given
    (which must be the same on every rank), in rounds of a multiple of world matrices (but the
    last), closed once their whole matrices pass world x `MAX_STACK_BYTES`. Each owner then holds
    about one batch's worth, and since owners are round-robin within a round, they are round-robin
    over the whole group: a model of huge matrices, one per round, would leave all the work to
    the first rank otherwise."""
    plain = [p for p in params if layout_of(p) is None]
    rounds = ns_batches(plain, batched, dtype)
    groups: dict[tuple[dist.ProcessGroup, torch.dtype], list[torch.Tensor]] = defaultdict(list)
    for p in params:
        layout = layout_of(p)
        if layout is not None:
            groups[(layout.group, p.dtype)].append(p)
    for (group, _), members in groups.items():
        world = dist.get_world_size(group)
        budget = world * MAX_STACK_BYTES
        current: list[torch.Tensor] = []
        used = 0
        for p in members:
            size = p.numel() * max(p.element_size(), dtype.itemsize)
            if current and len(current) % world == 0 and used + size > budget:
                rounds.append(current)
                current, used = [], 0
            current.append(p)
            used += size
        rounds.append(current)
    return rounds


def orthogonalize_matrices(params: list[torch.Tensor], updates: Sequence[torch.Tensor], steps: int,
                           dtype: torch.dtype, batched: bool | None = None) -> list[torch.Tensor]:
    """Newton-Schulz of each whole matrix whose local part is `updates[i]` (one list from
    `matrix_rounds`), returned as this rank's part of each result, in the updates' dtype.

    Plain matrices: `orthogonalize` (one batch). Sharded ones: gathered on their owner,
    orthogonalised there, and scattered back (module docstring); two all-to-alls on the round's
    shard group, which every rank of it must call with the same round."""
    found = [layout_of(p) for p in params]
    if found[0] is None:
        return orthogonalize(updates, steps, dtype)
    layouts = [layout for layout in found if layout is not None]
    if len(layouts) != len(params):
        raise ValueError("a round mixes plain and sharded matrices: matrix_rounds keeps them apart")
    shapes = [tuple(p.shape) for p in params]
    group, world, me = layouts[0].group, layouts[0].world, layouts[0].rank
    owner = [i % world for i in range(len(params))]
    mine = [i for i in range(len(params)) if owner[i] == me]

    # 1. Every rank's piece of each matrix to the matrix's owner.
    send = torch.cat([u.reshape(-1) for k in range(world) for i, u in enumerate(updates) if owner[i] == k])
    send_split = [sum(updates[i].numel() for i in range(len(params)) if owner[i] == k) for k in range(world)]
    recv_split = [sum(layouts[i].piece_numel(shapes[i], k) for i in mine) for k in range(world)]
    recv = send.new_empty(sum(recv_split))
    dist.all_to_all_single(recv, send, recv_split, send_split, group=group)
    del send
    pieces: defaultdict[int, list[torch.Tensor]] = defaultdict(list)
    offset = 0
    for k in range(world):  # from rank k: its pieces of my matrices, in round order
        for i in mine:
            n = layouts[i].piece_numel(shapes[i], k)
            pieces[i].append(recv[offset:offset + n].view(layouts[i].piece_shape(shapes[i], k)))
            offset += n
    whole = {i: torch.cat(pieces[i], dim=layouts[i].dim) for i in mine}
    del recv, pieces

    # 2. The owner orthogonalises its matrices, batched as one process would batch them.
    matrices = [whole[i] for i in mine]
    result: dict[int, torch.Tensor] = {}
    for batch in ns_batches(matrices, batched, dtype):
        for m, q in zip(batch, orthogonalize(batch, steps, dtype), strict=True):
            result[id(m)] = q
    ortho = {i: result[id(whole[i])] for i in mine}
    del whole, matrices, result

    # 3. Each rank's piece of every result back to it.
    send = torch.cat([ortho[i].narrow(layouts[i].dim, layouts[i].offset(k), layouts[i].sizes[k]).reshape(-1)
                      for k in range(world) for i in mine]) if mine else updates[0].new_empty(0)
    send_split = [sum(layouts[i].piece_numel(shapes[i], k) for i in mine) for k in range(world)]
    recv_split = [sum(updates[i].numel() for i in range(len(params)) if owner[i] == k) for k in range(world)]
    recv = updates[0].new_empty(sum(recv_split))
    dist.all_to_all_single(recv, send, recv_split, send_split, group=group)
    out: dict[int, torch.Tensor] = {}
    offset = 0
    for k in range(world):  # from owner k: my pieces of its matrices, in round order
        for i in range(len(params)):
            if owner[i] == k:
                n = updates[i].numel()
                out[i] = recv[offset:offset + n].view(updates[i].shape)
                offset += n
    return [out[i] for i in range(len(params))]  # every matrix has an owner in range(world)
