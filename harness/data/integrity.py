"""Is a shard what the index says? Size always; sha256 when asked.

Used by `harness data verify` (every shard, hashed) and by the shard reader when it opens a
shard for training (`data.hash_check`: off / first-open / always).
"""

from __future__ import annotations

from harness.checkpoint.location import Location, hash_file
from harness.data.shard_index import ShardEntry


def shard_problem(loc: Location, entry: ShardEntry, itemsize: int, *, check_hash: bool) -> str | None:
    """What is wrong with the shard `entry` at `loc` (missing, wrong size, wrong sha256), or None."""
    path = loc.join(entry.name)
    where = loc.url_of(path)
    expected = entry.tokens * itemsize
    try:
        size = loc.fs.size(path)
    except FileNotFoundError:
        return f"shard {where} is missing"
    if size != expected:
        return f"shard {where} is {size} bytes, the index says {entry.tokens} tokens = {expected} bytes"
    if check_hash:
        _, sha256 = hash_file(loc, path)
        if sha256 != entry.sha256:
            return f"shard {where} is corrupt: sha256 {sha256[:16]}..., the index says {entry.sha256[:16]}..."
    return None
