"""Large files written to local disk around the page cache (`O_DIRECT`): `DirectWriter`.

Why: a buffered write of a multi-GB checkpoint costs the kernel a page-cache page per 4 KiB
(allocate, copy, account as dirty, write back, reclaim), and that work lands on the cores the
training step runs on. On the reference machine (2 vCPUs, ext4 on virtio) writing 4 GiB through
the page cache and fsyncing it took 10-15 s with one core busy in the kernel the whole time (45%
system time of the machine); the same bytes written with `O_DIRECT` took 3.5-3.8 s at 6.5% system
time (docs/bench-scale.md, "Direct writes"). A checkpoint is written once and read back only on a
resume, usually by another process, so caching its pages buys nothing.

How: `O_DIRECT` needs the memory, the file offset and the length of every write aligned to the
device's block, which a safetensors file's bytes are not (its header has any length). So the
bytes given to `write` are copied into a few page-aligned buffers of `BUFFER_BYTES` (a NumPy copy,
which releases the GIL: the step loop's thread keeps running), and each full buffer is written at
its aligned offset by a worker thread while the next one fills (`IN_FLIGHT` writes at a time, so
the device always has one queued). The memory a writer adds is `BUFFERS * BUFFER_BYTES`.

The file starts out as an ordinary one and turns to `O_DIRECT` (`fcntl F_SETFL`) when the first
buffer is full: a file smaller than one buffer is written through the page cache in one call, and
a filesystem that refuses `O_DIRECT` (tmpfs on older kernels, some network filesystems) is written
through the page cache from then on, with no copy. `flush` writes the last, partial buffer
through the page cache (no padding, no truncation); `fsync` then makes everything durable as
for any file (`O_DIRECT` alone does not flush the device's cache or the file's metadata).

Where: local folders on a block device (`suits`); `HARNESS_DIRECT_IO=0` in the environment turns
it off (every write through the page cache).
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

BUFFER_BYTES = 8 << 20
BUFFERS = 3
IN_FLIGHT = BUFFERS - 1  # one buffer fills while the others are written
ENV = "HARNESS_DIRECT_IO"


def suits(folder: str) -> bool:
    """Whether large files written into `folder` go around the page cache: unless
    `HARNESS_DIRECT_IO` is "0", where the folder's filesystem lies on a block device. Not on a
    tmpfs (a RAM tier: its pages are the storage, so a write there is a memory copy either way,
    and the hash is better off in its own thread beside it), nor on a network or other virtual
    filesystem (device major 0), whose `O_DIRECT` means something else or nothing. (The local
    tier at 2 ranks in /dev/shm, `scale_local.py`, took the same time both ways: 3.1-3.3 s to
    save 0.5 GiB and copy it to the peer, 8.8-9.0 s for 1 GiB; 2.2 and 8.5 s before this pass.)"""
    if os.environ.get(ENV, "1") == "0" or not hasattr(os, "O_DIRECT"):
        return False
    try:
        return os.major(os.stat(folder).st_dev) != 0
    except OSError:
        return False


def _write_all(fd: int, data: Any, offset: int) -> None:
    view = memoryview(data)
    while len(view):
        n = os.pwrite(fd, view, offset)
        if n <= 0:  # a regular file never takes nothing; looping on it would never end
            raise OSError(errno.EIO, f"pwrite wrote {n} of {len(view)} bytes at offset {offset}")
        view, offset = view[n:], offset + n


class DirectWriter:
    """A new (or truncated) file at `path`, written sequentially: `write`, `flush`, `fileno`,
    `close`, as a binary file of `open(path, "wb")` (the module docstring says how). A failed
    background write is raised by the next `write`, `flush` or `close`."""

    def __init__(self, path: str) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o644)
        self.closed = False
        self._direct: bool | None = None  # writes go around the page cache now (None: no buffer was full yet)
        self.went_direct: bool | None = None  # whether the full buffers did (None: the file never filled one)
        self._offset = 0  # where the buffer being filled starts in the file
        self._fill = 0
        self._buffers: list[np.ndarray] = []
        self._free: deque[int] = deque()
        self._writes: deque[tuple[Future[None], int]] = deque()  # (the write, its buffer's index)
        self._pool: ThreadPoolExecutor | None = None
        self._failed = False  # a write failed: `close` writes nothing more

    def fileno(self) -> int:
        return self._fd

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if self._direct is False:
            _write_all(self._fd, view, self._offset)
            self._offset += len(view)
            return len(view)
        src = np.frombuffer(view, dtype=np.uint8)
        at = 0
        while at < len(src):
            buf = self._buffer()
            take = min(len(src) - at, BUFFER_BYTES - self._fill)
            buf[self._fill:self._fill + take] = src[at:at + take]
            self._fill += take
            at += take
            if self._fill == BUFFER_BYTES:
                self._submit()
        return len(src)

    def _buffer(self) -> np.ndarray:
        if not self._free:
            if len(self._buffers) < BUFFERS:
                self._buffers.append(np.frombuffer(mmap.mmap(-1, BUFFER_BYTES), dtype=np.uint8))  # page-aligned
                self._free.append(len(self._buffers) - 1)
            else:
                self._wait_one()
        return self._buffers[self._free[0]]

    def _submit(self) -> None:
        if self._direct is None:
            self._direct = self.went_direct = _turn_direct(self._fd)
        index = self._free.popleft()
        if self._direct:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(IN_FLIGHT, thread_name_prefix="direct-write")
            self._writes.append((self._pool.submit(_write_all, self._fd, self._buffers[index], self._offset), index))
        else:  # the filesystem refused O_DIRECT: this buffer as it is, then every write straight through
            _write_all(self._fd, self._buffers[index], self._offset)
            self._free.append(index)
        self._offset += BUFFER_BYTES
        self._fill = 0

    def _wait_one(self) -> None:
        write, index = self._writes.popleft()
        self._free.append(index)
        try:
            write.result()
        except BaseException:
            self._failed = True
            raise

    def flush(self) -> None:
        """Every byte given so far is in the file (not yet durable: `os.fsync`). Writes after
        this go through the page cache."""
        while self._writes:
            self._wait_one()
        if self._direct:
            fcntl.fcntl(self._fd, fcntl.F_SETFL, fcntl.fcntl(self._fd, fcntl.F_GETFL) & ~os.O_DIRECT)
        if self._fill:
            _write_all(self._fd, self._buffers[self._free[0]][:self._fill], self._offset)
            self._offset += self._fill
            self._fill = 0
        self._direct = False
        self._buffers, self._free = [], deque()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            if not self._failed:
                self.flush()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
            os.close(self._fd)

    def __enter__(self) -> DirectWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _turn_direct(fd: int) -> bool:
    """Set `O_DIRECT` on `fd`; False when the filesystem refuses it."""
    if not hasattr(os, "O_DIRECT"):
        return False
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_DIRECT)
    except OSError:
        return False
    return True
