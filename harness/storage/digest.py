"""The integrity hashes a manifest can name for a file, and the one new checkpoints use.

BLAKE3 (the `blake3` package: SIMD in Rust, and it releases the GIL while it hashes) is what
manifests of version 2 name for every file. sha256, which version 1 named, ran at about
1.4 GB/s on one core of the reference machine, slower than reading a checkpoint from the page
cache, so a verified resume (every byte hashed as it loads) took twice a raw read; BLAKE3 is
several times faster on the same core (docs/bench-checkpoint.md). Old manifests still verify:
the algorithm is named per file, and every name here can be checked.

Both detect corruption (a torn write, a flipped bit, a truncated upload); neither is a
signature: whoever can rewrite a file can rewrite the manifest too.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from typing import Protocol

import blake3

from harness.topology import process_cores

DEFAULT_ALGORITHM = "blake3"

# Whether this process is a fork of one that may have hashed over every core. BLAKE3's threads
# are a process-wide pool (Rust's rayon), started by the first multi-threaded hash; a fork copies
# the pool's state but not its threads, so a forked child (a DataLoader worker checking a data
# shard) that hashes over it waits forever for threads that are not there.
_forked = False


def _note_fork() -> None:
    global _forked
    _forked = True


os.register_at_fork(after_in_child=_note_fork)


def hash_threads() -> int:
    """Threads a large hash is split over (the digest is the same whatever the count): every core
    this process may run on but one. A hash runs beside the thread that reads or writes the bytes
    it hashes (location.BackgroundHash); hashing over every core took that thread's CPU as it woke
    from the disk, and the disk waited: a cold verified read of 1 GiB on 2 cores took 1.13 s
    hashing on both and 0.79 s on one (medians of 9, docs/bench-checkpoint.md). A forked child
    hashes on its own thread (above)."""
    if _forked:
        return 1
    return max(1, len(process_cores()) - 1)


class Hasher(Protocol):
    """A hasher of `ALGORITHMS` (hashlib's and blake3's have these)."""

    def update(self, data: bytes | memoryview, /) -> object: ...

    def hexdigest(self) -> str: ...


def _blake3(threads: int) -> Hasher:
    # More than one thread: a pool of that many for this hasher alone (blake3's AUTO would use
    # rayon's process-wide pool, which a fork breaks, and every core).
    return blake3.blake3(max_threads=threads)


# Name in the manifest -> constructor of a hasher (given the threads it may use) with update()
# and hexdigest(); both give 64 hex digits.
ALGORITHMS: dict[str, Callable[[int], Hasher]] = {"blake3": _blake3, "sha256": lambda _threads: hashlib.sha256()}
HEX_DIGITS = 64

# Below this, a one-call hash runs on the calling thread: starting a pool took 0.3 ms for two
# threads and 1.5 ms for eight on the 2-core machine, and one thread hashes a megabyte in 0.5 ms.
_THREADED_MIN_BYTES = 1 << 20


def new_hasher(algorithm: str, threads: int | None = None) -> Hasher:
    """A fresh hasher for `algorithm` (a key of `ALGORITHMS`) on `threads` (`hash_threads()` when None)."""
    return ALGORITHMS[algorithm](threads or hash_threads())


def hexdigest(algorithm: str, data: bytes | memoryview) -> str:
    """The digest of `data` in one call (small files: state.json, a manifest's own checks)."""
    h = new_hasher(algorithm, 1 if len(data) < _THREADED_MIN_BYTES else None)
    h.update(data)
    return h.hexdigest()
