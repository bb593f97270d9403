"""Is a shard what the index says? Size always; sha256 when asked; its end-of-document count when asked.

Used by `harness data verify` (every shard, hashed and its EOD ids counted) and by the shard
reader when it opens a shard for training (`data.hash_check`: off / first-open / always).
"""

from __future__ import annotations

import numpy as np

from harness.data.shard_index import ShardEntry
from harness.storage.location import HashingReader, Location, hash_file, open_read

_CHUNK = 8 << 20


def shard_problem(loc: Location, entry: ShardEntry, itemsize: int, *, check_hash: bool,
                  eod_id: int | None = None) -> str | None:
    """What is wrong with the shard `entry` at `loc` (missing, wrong size, wrong sha256, another
    number of `eod_id` tokens than the index's document count), or None. `eod_id` is counted in
    the same read as the hash, so only with `check_hash`."""
    path = loc.join(entry.name)
    where = loc.url_of(path)
    expected = entry.tokens * itemsize
    try:
        size = loc.fs.size(path)
    except FileNotFoundError:
        return f"shard {where} is missing"
    if size != expected:
        return f"shard {where} is {size} bytes, the index says {entry.tokens} tokens = {expected} bytes"
    if not check_hash:
        return None
    if eod_id is None:
        _, sha256 = hash_file(loc, path)
        eods = entry.documents
    else:
        sha256, eods = _hash_and_count(loc, path, itemsize, eod_id)
    if sha256 != entry.sha256:
        return f"shard {where} is corrupt: sha256 {sha256[:16]}..., the index says {entry.sha256[:16]}..."
    if eods != entry.documents:
        # The index counts documents by their EOD ids: a tokenizer that also emits that id for text
        # (an unknown-word token used as the separator) made a dataset whose documents are not where it says.
        return (f"shard {where} holds {eods} end-of-document ids ({eod_id}), the index says {entry.documents} "
                f"documents: the separator token also stands for text")
    return None


def _hash_and_count(loc: Location, path: str, itemsize: int, eod_id: int) -> tuple[str, int]:
    """(sha256, number of `eod_id` tokens) of the shard at `path`, in one read."""
    dtype = np.dtype(f"<u{itemsize}")
    count = 0
    part = b""  # a token cut by a short read
    with HashingReader(open_read(loc, path, prefetch=True)) as reader:
        # Fresh bytes per chunk: the hash runs in a thread over the very buffers read.
        while chunk := reader.read(_CHUNK):
            data = part + chunk if part else chunk
            tokens = np.frombuffer(data, dtype=dtype, count=len(data) // itemsize)
            count += int(np.count_nonzero(tokens == eod_id))
            part = data[len(tokens) * itemsize:]
        return reader.finish()[1], count
