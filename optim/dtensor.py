"""DTensor checks that do not import `torch.distributed.tensor`.

Importing that package costs more than a second (it loads sympy through torch.fx), and a
process that never shards a model never creates a DTensor. A tensor can only be a DTensor once
the package is loaded, so `is_dtensor` looks for it in `sys.modules` instead of importing it.
Code that builds DTensors or reads their placements imports the package where it does so, on
paths only a sharded run reaches. What it saves: the commands that build no optimizer
(`harness ckpt diff|ls|show|verify`, `harness status`, `--help`) start 1.3 s sooner on the
2-core machine (`harness ckpt diff` 5.3-5.5 s -> 4.0-4.2 s). A training process loads DTensor
all the same: torch's optimizers import torch._dynamo on their first parameter group, and dynamo
imports FSDP.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, TypeGuard

import torch

if TYPE_CHECKING:  # for the checker only: importing it is what this module avoids
    from torch.distributed.tensor import DTensor


def is_dtensor(t: object) -> TypeGuard[DTensor]:
    """Whether `t` is a DTensor (FSDP2's sharded parameters and state)."""
    package = sys.modules.get("torch.distributed.tensor")
    return package is not None and isinstance(t, package.DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """The part of `t` this rank holds (a view: in-place ops on it update `t`): a DTensor's local
    shard, a plain tensor itself."""
    return t.to_local() if is_dtensor(t) else t


def local_grad(p: torch.Tensor) -> torch.Tensor:
    """`local(p.grad)` of a parameter that an optimizer's step kept for having a gradient."""
    if p.grad is None:
        raise ValueError("a parameter without a gradient reached an optimizer's update")
    return local(p.grad)
