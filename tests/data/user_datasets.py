"""Users' own datasets for the data.factory tests (imported by path: tests/data is on PYTHONPATH there)."""

from __future__ import annotations

import torch


class Arithmetic:
    """Sample i: the sequence i, i+1, ... mod `vocab`, a pure function of i."""

    vocab_size = 37

    def __init__(self, first: int, count: int, seq_len: int) -> None:
        self.first, self.num_samples, self.seq_len = first, count, seq_len

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = (self.first + index) * 3
        window = torch.arange(start, start + self.seq_len + 1) % self.vocab_size
        return window[:-1], window[1:]

    def sample_id(self, index: int) -> int:
        return self.first + index

    def identity(self) -> dict:
        return {"name": "arithmetic", "vocab": self.vocab_size}


def build(args: dict) -> tuple[Arithmetic, Arithmetic]:
    return Arithmetic(0, args["train"], args["seq_len"]), Arithmetic(args["train"], 16, args["seq_len"])


class Noisy(Arithmetic):
    """Draws from its own generator: its samples depend on how many were read before."""

    def __init__(self, *a) -> None:
        super().__init__(*a)
        self.generator = torch.Generator().manual_seed(0)


def build_noisy(args: dict) -> tuple[Noisy, Noisy]:
    return Noisy(0, 64, args["seq_len"]), Noisy(64, 16, args["seq_len"])


def build_one(args: dict) -> Arithmetic:
    return Arithmetic(0, 64, args["seq_len"])
