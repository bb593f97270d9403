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


class RandomWalk:
    """A stateful iterator: each sample continues a random walk over the vocabulary, drawn from
    its own generator, one stream per rank. Its state: a count (JSON) and the generator (a tensor)."""

    vocab_size = 37

    def __init__(self, seed: int, rank: int, seq_len: int) -> None:
        self.seq_len = seq_len
        self.generator = torch.Generator().manual_seed(seed * 1000 + rank)
        self.count, self.token = 0, rank

    def __iter__(self) -> RandomWalk:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        steps = torch.randint(1, 4, (self.seq_len + 1,), generator=self.generator)
        window = (self.token + steps.cumsum(0)) % self.vocab_size
        self.token = int(window[-1])
        self.count += 1
        return window[:-1], window[1:], self.count - 1

    def state_dict(self) -> dict:
        return {"count": self.count, "token": self.token, "generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.count, self.token = state["count"], state["token"]
        self.generator.set_state(state["generator"])


def build_walk(args: dict) -> tuple[RandomWalk, Arithmetic]:
    return RandomWalk(args["seed"], args["rank"], args["seq_len"]), Arithmetic(1000, 16, args["seq_len"])


class Stateless(RandomWalk):
    """An iterator whose position no checkpoint could hold."""

    state_dict = None
    load_state_dict = None


def build_stateless(args: dict) -> tuple[Stateless, Arithmetic]:
    return Stateless(0, 0, args["seq_len"]), Arithmetic(1000, 16, args["seq_len"])


class WithASet(RandomWalk):
    def state_dict(self) -> dict:
        return {"seen": {1, 2}}


def build_with_a_set(args: dict) -> tuple[WithASet, Arithmetic]:
    return WithASet(0, 0, args["seq_len"]), Arithmetic(1000, 16, args["seq_len"])
