"""Token windows: over a text's bytes read from any fsspec URL, or over prepared token shards.

Tokens are either the file's bytes (vocabulary `VOCAB_SIZE` = 256), held once as a uint8
tensor, or a `TokenStore` such as `ShardReader` (shard_reader.py), which reads ranges on demand.
Sample `i` is window `w = first_window + i`: tokens `[w*T, w*T + T + 1)` for `T = seq_len`,
returned as int64 `x = window[:-1]`, `y = window[1:]`. Consecutive windows share one token (the
last target of one is the first input of the next), so every token is predicted exactly once.
A sample's id is its window index in the whole token stream, so a train and an eval split never
share an id.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

import numpy as np
import torch

from harness.data.corpus import default_corpus
from harness.errors import UserError
from harness.storage.filesystem import open_filesystem

VOCAB_SIZE = 256


@contextmanager
def data_errors(url: str) -> Iterator[None]:
    """Turn a missing or unopenable data file at `url` into a UserError saying what to fix."""
    try:
        yield
    except FileNotFoundError as e:
        raise UserError(
            f"data file {url!r} not found: fix the data URL in the config, "
            "or leave it unset to train on the built-in corpus"
        ) from e
    except (ValueError, ImportError) as e:
        raise UserError(
            f"data URL {url!r} cannot be opened ({e}); use a local path or an fsspec URL such as s3://"
        ) from e


class SampleSource(Protocol):
    """What `BatchStream` and `eval_batches` need from a dataset. Optional: `windows(indices)`
    (a batch in one read, see `fetch_samples`) and `for_epoch(epoch)` (the view of one epoch,
    for datasets whose slots map to samples per epoch, like `Mixture`)."""

    @property
    def num_samples(self) -> int: ...

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]: ...

    def sample_id(self, index: int) -> int: ...


class TokenStore(Protocol):
    """Tokens read on demand (`ShardReader`): how many there are, and ranges of them."""

    def __len__(self) -> int: ...

    def read_windows(self, starts: list[int], length: int) -> np.ndarray: ...


class TokenDataset:
    """Windows of `seq_len + 1` tokens; see the module docstring for the layout."""

    def __init__(self, tokens: torch.Tensor | TokenStore, seq_len: int, first_window: int = 0,
                 num_windows: int | None = None):
        if seq_len < 1:
            raise UserError(f"seq_len must be >= 1, got {seq_len}")
        total = (len(tokens) - 1) // seq_len
        if total < 1:
            raise UserError(
                f"the data has {len(tokens)} tokens, too short for one window of seq_len + 1 = {seq_len + 1}: "
                "use more data or a smaller seq_len"
            )
        self.tokens = tokens
        self.seq_len = seq_len
        self.first_window = first_window
        self.num_samples = total - first_window if num_windows is None else num_windows
        if first_window < 0 or self.num_samples < 1 or first_window + self.num_samples > total:
            raise ValueError(f"windows [{first_window}, {first_window + self.num_samples}) outside [0, {total})")

    @classmethod
    def from_url(cls, url: str | None, seq_len: int, storage_options: dict | None = None) -> TokenDataset:
        """Read the whole file at `url` (None: the built-in corpus). Raises UserError if it is missing."""
        if url is None:
            return cls.from_bytes(default_corpus(), seq_len)
        with data_errors(url):
            # The store's filesystem: bounded retries whose jitter never draws from the global RNG.
            fs, path = open_filesystem(url, storage_options)
            data = fs.cat_file(path)
        return cls.from_bytes(data, seq_len)

    @classmethod
    def from_bytes(cls, data: bytes, seq_len: int) -> TokenDataset:
        # bytearray: torch.frombuffer needs a writable buffer to avoid a warning, and it must
        # outlive the tensor, which the tensor's reference guarantees.
        if not data:
            return cls(torch.empty(0, dtype=torch.uint8), seq_len)
        return cls(torch.frombuffer(bytearray(data), dtype=torch.uint8), seq_len)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        window = self.windows([index])[0]
        return window[:-1], window[1:]

    def sample_id(self, index: int) -> int:
        return self.first_window + index

    def windows(self, indices: list[int]) -> torch.Tensor:
        """The windows of samples `indices`, int64 [len, seq_len + 1]; a token store reads them
        in one call (concurrent ranged reads when remote)."""
        for index in indices:
            if not 0 <= index < self.num_samples:
                raise IndexError(f"sample {index} outside [0, {self.num_samples})")
        starts = [self.sample_id(i) * self.seq_len for i in indices]
        if isinstance(self.tokens, torch.Tensor):
            return torch.stack([self.tokens[a : a + self.seq_len + 1].long() for a in starts])
        return torch.from_numpy(self.tokens.read_windows(starts, self.seq_len + 1))

    def split(self, eval_fraction: float) -> tuple[TokenDataset, TokenDataset]:
        """(train, eval): the last `ceil(eval_fraction * num_samples)` windows are the eval set."""
        if not 0.0 < eval_fraction < 1.0:
            raise UserError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
        num_eval = math.ceil(eval_fraction * self.num_samples)
        num_train = self.num_samples - num_eval
        if num_train < 1:
            raise UserError(
                f"eval_fraction {eval_fraction} leaves no training windows out of {self.num_samples}: lower it"
            )
        train = TokenDataset(self.tokens, self.seq_len, self.first_window, num_train)
        held_out = TokenDataset(self.tokens, self.seq_len, self.first_window + num_train, num_eval)
        return train, held_out
