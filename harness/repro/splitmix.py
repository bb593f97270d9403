"""Portable deterministic integers: SplitMix64 in pure Python.

Python's `random` may change its algorithms between versions, and the data order and the
built-in corpus must be identical on every machine, so anything that turns a seed into choices
here goes through this fixed, documented generator (Steele, Lea & Flood, "Fast splittable
pseudorandom number generators", OOPSLA 2014) instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

_MASK64 = (1 << 64) - 1
_GOLDEN_GAMMA = 0x9E3779B97F4A7C15

T = TypeVar("T")


def _mix64(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


class SplitMix64:
    """A stream of 64-bit integers that depends only on the seed."""

    def __init__(self, seed: int) -> None:
        self._state = seed & _MASK64

    def next_u64(self) -> int:
        self._state = (self._state + _GOLDEN_GAMMA) & _MASK64
        return _mix64(self._state)

    def choice(self, options: Sequence[T]) -> T:
        # The modulo bias (< 2**-50 for our option counts) is irrelevant: we need a fixed
        # function of the seed, not perfect uniformity.
        return options[self.next_u64() % len(options)]


def derive_seed(*parts: int) -> int:
    """A 63-bit seed that is a fixed function of `parts` (e.g. seed, epoch), fit for
    `torch.Generator.manual_seed`. Different part tuples give unrelated seeds."""
    state = 0
    for part in parts:
        state = _mix64((state + _GOLDEN_GAMMA + (part & _MASK64)) & _MASK64)
    return state >> 1
