"""A local file read front to back with the kernel kept reading ahead of it: `ReadAhead`.

Why: Linux reads a file ahead of sequential reads one read-ahead window at a time (the device's
`read_ahead_kb`: 8 MiB on the reference machine), so a reader of 8-16 MiB pieces leaves the disk one
window's requests at a time, and `POSIX_FADV_WILLNEED` is capped at one window per call. On the
reference machine (a virtio disk) a cold 2.5 GiB file read in 8 MiB pieces took 6.6-13.3 s, and
2.7-3.0 s with the advice given for the pieces 128-512 MiB ahead of the reads; a resume's cold
restore of 4 GiB went from 7.88 s to 4.52 s (docs/bench-scale.md, sixth pass).

Contract: a `ReadAhead` reads, seeks and closes like the file it wraps (every other attribute is
the file's). Before each read it asks the kernel (`POSIX_FADV_WILLNEED`, one window per call) for
the bytes up to `AHEAD_BYTES` past the read's end, starting with one window at the open; the
distance doubles with what was read, up to `AHEAD_BYTES`, so a reader that reads a header and
stops asks for little more than the kernel's own window. Advice only: nothing it does changes the
bytes read, and the pages it asks for are the page cache's, reclaimed like any other.
"""

from __future__ import annotations

import os
from typing import Any

WINDOW_BYTES = 8 << 20  # one advice: the device's read-ahead window on the reference machine
AHEAD_BYTES = 128 << 20  # how far past a read the kernel is asked to have read, at most


class ReadAhead:
    """A local binary file (with `fileno`) read front to back; see the module's contract."""

    def __init__(self, f: Any) -> None:
        self._f = f
        self._size = os.fstat(f.fileno()).st_size
        self._read = 0  # bytes read so far: the distance asked ahead grows with them
        self._advised = 0  # the kernel was asked for the bytes up to here, from the last read on
        self._advise(0, WINDOW_BYTES)

    def _advise(self, start: int, end: int) -> None:
        """Ask for [start, end), less what was asked for already; bytes skipped by a seek never."""
        self._advised = max(self._advised, start)
        while self._advised < min(end, self._size):
            os.posix_fadvise(self._f.fileno(), self._advised, WINDOW_BYTES, os.POSIX_FADV_WILLNEED)
            self._advised += WINDOW_BYTES

    def _before_read(self, n: int) -> None:
        at = self._f.tell()
        self._advise(at, at + n + min(AHEAD_BYTES, max(WINDOW_BYTES, 2 * self._read)))

    def read(self, n: int = -1) -> bytes:
        self._before_read(self._size if n is None or n < 0 else n)
        data: bytes = self._f.read(n)
        self._read += len(data)
        return data

    def readinto(self, view: Any) -> int:
        self._before_read(memoryview(view).nbytes)
        got: int = self._f.readinto(view)
        self._read += got
        return got

    def __getattr__(self, name: str) -> Any:  # seek, tell, fileno, close, ...: the file's own
        return getattr(self._f, name)

    def __enter__(self) -> ReadAhead:
        return self

    def __exit__(self, *exc: object) -> None:
        self._f.close()
