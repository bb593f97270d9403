"""`ShardReader`: token ranges of a prepared dataset, as if its shards were one flat array.

Local shards are read with `preadv` straight into the batch's staging buffer (at most
`OPEN_FILES` descriptors open, least recently used closed). Not memory-mapped, unlike the
design: windows are read in random order, and a map's page faults map the pages around each
fault too (the kernel's fault-around ignores MADV_RANDOM), so the process's resident memory grew
with the dataset (ops/bench/data_io.py: peak RSS 1.35x for a 10x dataset with a map); `preadv`
holds only the bytes asked for. Remote shards (S3, any fsspec URL) are read with ranged requests
through the harness's retrying filesystem (`open_filesystem`): a batch's windows go out as one
`cat_ranges` call, fetched concurrently. Read-ahead is bounded by the loader: `prefetch_factor`
batches per DataLoader worker, none with `num_workers = 0`.

The first read of a shard checks its size against the index (a truncated or missing shard is a
UserError naming it, not a short read later) and, unless `hash_check` is "off", its sha256.
"first-open": once in the process that first reads it, and the set of shards checked travels
with the reader when it is handed to DataLoader workers; "always": once in every process that
reads it (every worker, every epoch's workers).

The reader pickles without its descriptors and filesystem (workers reopen them), so handing it
to a worker process copies a few numbers, never the data.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import Literal

import numpy as np

from harness.data.integrity import shard_problem
from harness.data.shard_index import ShardIndex, read_index
from harness.errors import UserError
from harness.storage.location import Location, open_location

HashCheck = Literal["off", "first-open", "always"]
OPEN_FILES = 128


class ShardReader:
    """Token ranges `[start, stop)` over all shards of one dataset, in index order."""

    def __init__(self, url: str, index: ShardIndex, storage_options: dict | None = None,
                 hash_check: HashCheck = "first-open") -> None:
        self.url = url
        self.index = index
        self.storage_options = storage_options
        self.hash_check = hash_check
        self.dtype = np.dtype(index.dtype).newbyteorder("<")
        self.offsets = [0]
        for entry in index.shards:
            self.offsets.append(self.offsets[-1] + entry.tokens)
        self._ends = np.asarray(self.offsets[1:], dtype=np.int64)  # shard of token t: searchsorted(right)
        self._checked: set[int] = set()
        self._loc: Location | None = None
        self._files: OrderedDict[int, int] = OrderedDict()  # shard -> open descriptor, least recent first
        self._pid = os.getpid()  # whose `_loc` and `_files` they are

    @classmethod
    def open(cls, url: str, storage_options: dict | None = None, hash_check: HashCheck = "first-open") -> ShardReader:
        """Read only `index.json` at `url`; shards are opened when first read."""
        index, _ = read_index(url, storage_options)
        return cls(url, index, storage_options, hash_check)

    def __len__(self) -> int:
        return self.offsets[-1]

    def __getstate__(self) -> dict:
        state = dict(self.__dict__, _loc=None, _files=OrderedDict(), _pid=None)
        if self.hash_check == "always":
            state["_checked"] = set()
        return state

    def read_windows(self, starts: list[int], length: int) -> np.ndarray:
        """Tokens `[start, start + length)` for each of `starts`, as int64 [len(starts), length]."""
        out = np.empty((len(starts), length), dtype=np.int64)
        first = np.searchsorted(self._ends, np.asarray(starts, dtype=np.int64), side="right").tolist()
        if starts and (min(starts) < 0 or max(starts) + length > len(self)):
            raise IndexError(f"a window of {length} tokens at {min(starts)}..{max(starts)} is outside the "
                             f"dataset's {len(self)} tokens")
        # (row, shard, start, stop) within shards; a window crossing a shard boundary is several.
        pieces = []
        for row, (start, shard) in enumerate(zip(starts, first, strict=True)):
            pos, stop = start, start + length
            while pos < stop:
                end = min(stop, self.offsets[shard + 1])
                pieces.append((row, shard, pos - self.offsets[shard], end - self.offsets[shard]))
                pos, shard = end, shard + 1
        for shard in sorted({shard for _, shard, _, _ in pieces}):
            self._ensure_open(shard)
        at = [0] * len(starts)
        if self._location().is_local:
            staged = np.empty((len(starts), length), dtype=self.dtype)
            for row, shard, a, b in pieces:
                # `.data`: memoryview(array), as numpy's stubs type it (its buffer protocol: Python 3.12+ only).
                view = staged[row, at[row]:at[row] + b - a].data.cast("B")
                if os.preadv(self._descriptor(shard), [view], a * self.dtype.itemsize) != len(view):
                    raise UserError(f"shard {self.index.shards[shard].name} of {self.url} ended early; it changed "
                                    f"while training")
                at[row] += b - a
            out[:] = staged
            return out
        loc = self._location()
        blobs = loc.fs.cat_ranges([loc.join(self.index.shards[shard].name) for _, shard, _, _ in pieces],
                                  [a * self.dtype.itemsize for _, _, a, _ in pieces],
                                  [b * self.dtype.itemsize for _, _, _, b in pieces], on_error="raise")
        for (row, _, a, b), blob in zip(pieces, blobs, strict=True):
            out[row, at[row]:at[row] + b - a] = np.frombuffer(blob, dtype=self.dtype)
            at[row] += b - a
        return out

    def _location(self) -> Location:
        if self._pid != os.getpid():
            # A forked DataLoader worker inherits the parent's reader (no pickling under fork):
            # the S3 filesystem's event loop is not fork-safe, and the descriptors are the parent's.
            self.close()
            self._loc, self._pid = None, os.getpid()
        if self._loc is None:
            self._loc = open_location(self.url, self.storage_options)
        return self._loc

    def _ensure_open(self, shard: int) -> None:
        """Check the shard (size; sha256 unless `hash_check` is "off") once per `_checked` set."""
        if shard in self._checked:
            return
        problem = shard_problem(self._location(), self.index.shards[shard], self.index.itemsize,
                                check_hash=self.hash_check != "off")
        if problem:
            raise UserError(f"{problem}; run `harness data verify {self.url}` and prepare the dataset again")
        self._checked.add(shard)

    def _descriptor(self, shard: int) -> int:
        """An open descriptor of a local shard; at most `OPEN_FILES` stay open (least recent closed)."""
        self._location()  # a forked process drops the parent's descriptors first
        fd = self._files.pop(shard, None)
        if fd is None:
            fd = os.open(self._location().join(self.index.shards[shard].name), os.O_RDONLY)
            if len(self._files) >= OPEN_FILES:
                os.close(self._files.popitem(last=False)[1])
        self._files[shard] = fd
        return fd

    def close(self) -> None:
        while self._files:
            os.close(self._files.popitem()[1])

    def __del__(self) -> None:
        if hasattr(self, "_files"):
            self.close()
