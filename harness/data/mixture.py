"""`Mixture`: several token datasets drawn by weight into one sample space.

An epoch of the mixture has `N = sum of the sources' samples` slots. Source `s` gets
`count_s` of them, its share `w_s / sum(w)` of N rounded by largest remainder (ties to the
earlier source), in one block: slots `[C_s, C_s + count_s)`. Slot `C_s + k` of epoch `e` is
sample `perm_s[(e * count_s + k) mod n_s]` of source `s`, where `perm_s` is a fixed permutation
of its `n_s` samples drawn from (seed, s). So a source with more weight than its size repeats
samples within an epoch, one with less sees a different part of itself each epoch and all of it
over `ceil(n_s / count_s)` epochs, and everything is a pure function of (seed, epoch, slot). The
stream's epoch permutation (order.py) then shuffles the slots, so blocks never show in batches.

A sample's id is `s * 2**40 + its window index in source s`: unique across sources, and the same
window keeps its id in every epoch.
"""

from __future__ import annotations

import bisect
import copy

import torch

from harness.data.dataset import TokenDataset
from harness.data.order import epoch_permutation
from harness.errors import UserError
from harness.repro.splitmix import derive_seed

SOURCE_ID_STRIDE = 1 << 40
_MIXTURE_SALT = 0x4D4958  # "MIX": keeps the source permutations apart from the epoch order


class Mixture:
    """Sources by weight; `for_epoch(e)` is the view the stream reads epoch `e` through."""

    def __init__(self, sources: list[TokenDataset], weights: list[float], seed: int) -> None:
        if len(sources) != len(weights) or not sources:
            raise ValueError("one weight per source, at least one source")
        if any(w <= 0 for w in weights):
            raise UserError(f"data source weights must be > 0, got {weights}")
        self.sources = sources
        self.num_samples = sum(s.num_samples for s in sources)
        self.counts = _largest_remainder([w / sum(weights) * self.num_samples for w in weights], self.num_samples)
        self.starts = [0]
        for count in self.counts:
            self.starts.append(self.starts[-1] + count)
        self.permutations = [epoch_permutation(derive_seed(seed, _MIXTURE_SALT, s), 0, src.num_samples)
                             for s, src in enumerate(sources)]
        self.epoch = 0

    def for_epoch(self, epoch: int) -> Mixture:
        view = copy.copy(self)
        view.epoch = epoch
        return view

    def __len__(self) -> int:
        return self.num_samples

    def locate(self, index: int) -> tuple[int, int]:
        """(source, sample index in it) of slot `index` in this view's epoch."""
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} outside [0, {self.num_samples})")
        s = bisect.bisect_right(self.starts, index) - 1
        count, n = self.counts[s], self.sources[s].num_samples
        return s, int(self.permutations[s][(self.epoch * count + index - self.starts[s]) % n])

    def sample_id(self, index: int) -> int:
        s, local = self.locate(index)
        return s * SOURCE_ID_STRIDE + self.sources[s].sample_id(local)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        window = self.windows([index])[0]
        return window[:-1], window[1:]

    def windows(self, indices: list[int]) -> torch.Tensor:
        """int64 [len, seq_len + 1]; one batched read per source."""
        located = [self.locate(i) for i in indices]
        out: torch.Tensor | None = None
        for s, source in enumerate(self.sources):
            rows = [row for row, (src, _) in enumerate(located) if src == s]
            if not rows:
                continue
            got = source.windows([located[row][1] for row in rows])
            if out is None:
                out = torch.empty((len(indices), got.shape[1]), dtype=got.dtype)
            out[rows] = got
        assert out is not None, "no indices"
        return out


def _largest_remainder(shares: list[float], total: int) -> list[int]:
    counts = [int(x) for x in shares]
    by_remainder = sorted(range(len(shares)), key=lambda i: (-(shares[i] - counts[i]), i))
    for i in by_remainder[: total - sum(counts)]:
        counts[i] += 1
    return counts
