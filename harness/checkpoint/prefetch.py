"""Reading a checkpoint's tensor files into the page cache while the process builds what it loads into.

A resume builds its trainer (the model's initial weights, the optimizer) before it can load a
checkpoint into it: seconds for a multi-GB model, during which the disk sits idle, and then the
load reads the files from a cold disk. `Prefetch` reads the files the load will read, in the
order it reads them, in a thread of its own from the moment the checkpoint is chosen, so the
disk works while the model is built, and the load (which still reads and hashes every byte
itself: nothing is trusted from the prefetch) finds them in the page cache.

Bounded: the read goes through one reused buffer of `CHUNK_BYTES` (no resident memory beyond
it) and stops at half the memory the system has available, so the pages read first are not
evicted by the ones read last; it stops when the block ends (`close`). Local disk only: an
object store's bytes have no page cache to land in. Linux's own read-ahead advice cannot do this
alone: `POSIX_FADV_WILLNEED` is capped at the device's read-ahead window. The reads keep that
advice a bounded distance ahead of them (storage/read_ahead.py), so the disk has more than one
window's requests at a time: a resume's cold restore of 4 GiB took 4.52 s with it against 7.88 s
(docs/bench-scale.md, sixth pass).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import psutil

from harness.checkpoint.discovery import CheckpointRef
from harness.log import get_logger
from harness.storage.location import Location, open_read

log = get_logger(__name__)

CHUNK_BYTES = 8 << 20  # the device's read-ahead window on the reference machine: whole requests


class Prefetch:
    """Reads the files `names` of checkpoint `ref` at `loc` into the page cache in a daemon thread,
    from construction to `close` (a context manager); does nothing off local disk. `read`: the
    bytes read so far (for tests and logs)."""

    def __init__(self, loc: Location, ref: CheckpointRef, names: Iterable[str]) -> None:
        self.read = 0
        self._stop = threading.Event()
        self._thread = None
        if loc.is_local:
            paths = [f"{ref.path}/{name}" for name in names]
            budget = psutil.virtual_memory().available // 2
            self._thread = threading.Thread(target=self._run, args=(loc, paths, budget), name="ckpt-prefetch",
                                            daemon=True)
            self._thread.start()

    def _run(self, loc: Location, paths: list[str], budget: int) -> None:
        buffer = memoryview(bytearray(CHUNK_BYTES))
        try:
            for path in paths:
                with open_read(loc, path, prefetch=True) as f:
                    while self.read < budget and not self._stop.is_set() and (got := f.readinto(buffer)):
                        self.read += got
        except OSError as e:  # the load reads the files itself and reports what is wrong with them
            log.debug("checkpoint prefetch stopped", path=path, error=str(e))

    def close(self) -> None:
        """Stop reading and wait for the thread (at most one chunk's read)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def __enter__(self) -> Prefetch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
