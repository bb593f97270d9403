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
from typing import Any

import blake3

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


def _blake3() -> Any:
    # AUTO: a large update is split over every core (same digest). On the 2-core reference
    # machine a warm verified load took 1.24x a raw read with it, 2.4x on one thread. A forked
    # child hashes on its own thread (above).
    return blake3.blake3(max_threads=1 if _forked else blake3.blake3.AUTO)


# Name in the manifest -> constructor of a hasher with update() and hexdigest(); both give 64 hex digits.
ALGORITHMS: dict[str, Callable[[], Any]] = {"blake3": _blake3, "sha256": hashlib.sha256}
HEX_DIGITS = 64


def new_hasher(algorithm: str) -> Any:
    """A fresh hasher for `algorithm` (a key of `ALGORITHMS`)."""
    return ALGORITHMS[algorithm]()


def hexdigest(algorithm: str, data: bytes | memoryview) -> str:
    """The digest of `data` in one call (small files: state.json, a manifest's own checks)."""
    h = new_hasher(algorithm)
    h.update(data)
    return h.hexdigest()
