"""Small shared test helpers that start no process (those are in procs.py): seeded random tensors
and parameters for the optimizer tests, and the one-byte damage a checkpoint's verification must
find."""

from __future__ import annotations

from pathlib import Path

import torch


def random_tensors(shapes, seed: int) -> list[torch.Tensor]:
    """One standard-normal tensor per shape, drawn in order from a generator seeded with `seed`."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g) for s in shapes]


def make_params(shapes, seed: int = 0) -> list[torch.nn.Parameter]:
    """`random_tensors(shapes, seed)` as parameters: the same values for the same seed."""
    return [torch.nn.Parameter(t) for t in random_tensors(shapes, seed)]


def flip_byte(path: str | Path, at: int = -3, mask: int = 0x01) -> None:
    """Damage the file at `path` in place: the byte at index `at` XOR `mask`, the size unchanged (so
    only the content hash can tell)."""
    path = Path(path)
    data = bytearray(path.read_bytes())
    data[at] ^= mask
    path.write_bytes(bytes(data))
