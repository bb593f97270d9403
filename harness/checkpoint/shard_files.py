"""The names a sharded checkpoint uses (checkpoint/dcp.py writes and reads it through DCP),
apart from DCP itself: every checkpoint path knows these, while only a sharded run or load
imports torch.distributed.checkpoint (about a second at process start; optim/dtensor.py)."""

from __future__ import annotations

import torch

from optim.dtensor import local

SHARDED = "$dcp"
"""The pseudo file of a sharded part's tensors in a `Snapshot` and in state.json references."""
METADATA_FILE = "dcp-metadata.json"
MAX_METADATA_BYTES = 256 << 20


def shard_file(rank: int) -> str:
    """The safetensors file of rank `rank`'s shards."""
    return f"shards-{rank:05d}.safetensors"


def local_nbytes(t: torch.Tensor) -> int:
    """The bytes of `t` this rank holds (a DTensor's local shard, all of a plain tensor)."""
    part = local(t)
    return part.numel() * part.element_size()
