"""A `Location` (filesystem + root) and the I/O on it: durable writes, hashed reads, per kind of storage.

`open_location(url)` turns a local path or any fsspec URL into a `Location`. Writes differ by
kind on purpose:

* Local disk: files are written and fsynced, folders are fsynced after a rename, so a power loss
  after `commit` returns cannot lose or tear the checkpoint. Every local operation is a method of
  the `LocalDiskFileSystem` (filesystem.py), never a bare `os` call, so the fault layer sees it.
* Object stores and `memory://`: a single PUT is atomic and there is nothing to fsync; the
  commit point is the manifest object, written last (see store.py).

`write_stream` writes a file on a local disk around the page cache (direct_io.py), hashing each
chunk on the writing thread while the device writes the chunks before it; on a tmpfs or to S3 it
hashes in a second thread (`BackgroundHash`), behind the writes or the part uploads. Either way
the save waits for the hash only if the hash is slower than the storage: with BLAKE3 (digest.py)
it is faster than a disk or a network here. The hashers and file writes all release the GIL.
`HashingReader` does the same for loading: the bytes are hashed, in order, in a second thread
while the next ones are read, so a verified load reads every byte once and costs about a raw read
while the hash keeps up with the reads.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from harness.errors import StorageError
from harness.storage.digest import DEFAULT_ALGORITHM, new_hasher
from harness.storage.filesystem import open_filesystem
from harness.storage.read_ahead import ReadAhead

# Bytes given to the hash and not hashed yet, at most (`BackgroundHash`): the memory they hold
# beyond the caller's own (a message a peer copy received, a GPU tensor's host copy). Tensor
# files are written and read in pieces of 16 MiB at most (checkpoint/tensorfile.py), so the hash
# runs a few pieces behind the writes and reads, and waits for none while it keeps up.
_HASH_BACKLOG_BYTES = 64 << 20
_READ_CHUNK = 8 << 20


@dataclass(frozen=True)
class Location:
    """A filesystem and a root path inside it; `url` is what the user gave, for messages."""

    fs: Any
    root: str
    url: str

    @property
    def is_local(self) -> bool:
        return getattr(self.fs, "local_disk", False)

    def join(self, *names: str) -> str:
        return "/".join([self.root.rstrip("/"), *names])

    def url_of(self, path: str) -> str:
        """The user-facing address of `path` (a local path, or protocol://path)."""
        if self.is_local:
            return path
        protocol = self.fs.protocol[0] if isinstance(self.fs.protocol, tuple) else self.fs.protocol
        return f"{protocol}://{path.lstrip('/')}"


def folder_name(path: str) -> str:
    """The last component of a path in a location (a file's or folder's own name)."""
    return path.rstrip("/").rsplit("/", 1)[-1]


def open_location(url: str, storage_options: dict[str, Any] | None = None) -> Location:
    """Resolve `url` (local path or fsspec URL); an unknown protocol is a `StorageError`."""
    try:
        fs, root = open_filesystem(str(url), storage_options)
    except ValueError as e:
        protocol = str(url).split("://", 1)[0]
        raise StorageError(
            f"unknown storage protocol {protocol!r} in {url!r}: use a local path or an fsspec URL "
            f"such as s3://bucket/prefix or memory://name ({e})"
        ) from e
    except ImportError as e:
        raise StorageError(f"storage URL {url!r} needs a package that is not installed: {e}") from e
    if getattr(fs, "local_disk", False):
        root = os.path.abspath(root)
    return Location(fs=fs, root=root.rstrip("/") or "/", url=str(url))


def output_folder(url: str, storage_options: dict[str, Any] | None, what: str) -> Location:
    """Open `url` as a folder to write into, creating it. A path that is a file, or a folder that
    cannot be created, is a `StorageError` naming `what` (the flag or setting that gave it),
    raised before any work starts."""
    loc = open_location(url, storage_options)
    try:
        loc.fs.makedirs(loc.root, exist_ok=True)
    except FileExistsError:
        raise StorageError(f"{what} {url} is a file, not a folder: give a folder path") from None
    except OSError as e:
        raise StorageError(f"cannot write to {what} {url}: {e}; choose a writable {what}") from None
    return loc


def fsync_dir(loc: Location, path: str) -> None:
    """Make a rename or file creation inside local folder `path` durable."""
    loc.fs.fsync_dir(path)


def rename(loc: Location, src: str, dst: str) -> None:
    """Atomically rename `src` to `dst` on local disk (not durable until `fsync_dir` of the parent)."""
    loc.fs.replace(src, dst)


class BackgroundHash:
    """The digest (`algorithm`, digest.py) of the chunks given to `update`, in order, computed in
    a worker thread.

    A chunk is hashed where it lies (no copy), so it must not change until it is hashed; at most
    `_HASH_BACKLOG_BYTES` are waiting at any time (`update` blocks until the backlog is under
    it), so a chunk that is a temporary (a CPU copy of a GPU tensor) is kept alive only that
    long. `size` counts every byte given; `hexdigest()` waits for the backlog. Use it as a
    context manager, which stops the worker thread.
    """

    def __init__(self, algorithm: str = DEFAULT_ALGORITHM) -> None:
        self.size = 0
        self._digest = new_hasher(algorithm)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-hash")
        self._backlog: deque[tuple[Future[object], int]] = deque()
        self._pending = 0

    def update(self, chunk: memoryview | bytes) -> None:
        n = chunk.nbytes if isinstance(chunk, memoryview) else len(chunk)
        if not n:
            return
        self._backlog.append((self._pool.submit(self._digest.update, chunk), n))
        self._pending += n
        self.size += n
        while self._pending > _HASH_BACKLOG_BYTES:
            done, n_done = self._backlog.popleft()
            done.result()
            self._pending -= n_done

    def hexdigest(self) -> str:
        while self._backlog:
            self._backlog.popleft()[0].result()
        self._pending = 0
        return self._digest.hexdigest()

    def __enter__(self) -> BackgroundHash:
        return self

    def __exit__(self, *exc: object) -> None:
        self._pool.shutdown(wait=True)


def write_stream(loc: Location, path: str, chunks: Iterable[memoryview | bytes]) -> tuple[int, str]:
    """Write `chunks` to `path`, durably on local disk; return (size, digest hex under
    `DEFAULT_ALGORITHM`).

    On a local disk the file goes around the page cache (storage/direct_io.py: the device writes
    each buffer in the background) and each chunk is hashed on this thread as it is given, not in
    a hash thread beside it, which took the training step's core on the 2-core reference machine
    (docs/bench-scale.md; BLAKE3 still splits a chunk over every core but one, digest.py's
    `hash_threads`: there, one). The hash costs no time while it is faster than the disk.
    Elsewhere (a tmpfs, whose writes are memory copies; an upload) the hash runs behind the writes
    (`BackgroundHash`) and finishes during the fsync or while the last part is sent."""
    if loc.is_local and loc.fs.writes_direct(path):
        hasher, size = new_hasher(DEFAULT_ALGORITHM), 0

        def seen(chunk: memoryview | bytes) -> None:
            nonlocal size
            size += memoryview(chunk).nbytes
            hasher.update(chunk)

        _write(loc, path, chunks, seen, direct=True)
        return size, hasher.hexdigest()
    with BackgroundHash() as digest:
        _write(loc, path, chunks, digest.update)
        return digest.size, digest.hexdigest()


def write_small(loc: Location, path: str, data: bytes) -> None:
    """Write a small file whole (a manifest, a lease); durable on local disk. Not hashed: no
    manifest names its digest (a lease is rewritten every heartbeat)."""
    _write(loc, path, [data], lambda _chunk: None)


def _write(loc: Location, path: str, chunks: Iterable[memoryview | bytes],
           seen: Callable[[memoryview | bytes], None], direct: bool = False) -> None:
    # `direct` (local disk only): a large file goes around the page cache (storage/direct_io.py)
    with loc.fs.open(path, "wb", **({"direct": True} if direct else {})) as f:
        for chunk in chunks:
            seen(chunk)
            f.write(chunk)
        if loc.is_local:
            loc.fs.fsync(f)


def open_read(loc: Location, path: str, prefetch: bool = False) -> Any:
    """A binary reader with `seek` and `readinto` (the filesystem's file: a Python file on local
    disk, else fsspec's, which has no type information); unbuffered on local disk (large reads go
    straight into the destination tensor). `prefetch`: the file is read front to back, and on
    local disk the kernel is kept reading it ahead of the reads (`ReadAhead`, read_ahead.py)."""
    f = loc.fs.open(path, "rb")
    if loc.is_local and prefetch and hasattr(os, "posix_fadvise"):
        return ReadAhead(f)
    return f


class HashingReader:
    """A forward-only reader over the binary file `f` that hashes every byte it passes.

    `read`, `readinto` and `seek` (forward only: skipped bytes are read and hashed) behave like
    the file's own; `finish()` reads the rest of the file and returns (size, digest hex under
    `algorithm`) of all of it. The hash runs in a worker thread (`BackgroundHash`) over the very buffers the caller
    read into (live tensors, so no copy): those buffers must not change until `finish` returns.
    """

    def __init__(self, f: Any, algorithm: str = DEFAULT_ALGORITHM) -> None:  # a reader of `open_read`
        self._f = f
        self._hash = BackgroundHash(algorithm)

    def tell(self) -> int:
        return self._hash.size

    def read(self, n: int = -1) -> bytes:
        data: bytes = self._f.read(n)
        self._hash.update(data)
        return data

    def readinto(self, view: memoryview) -> int:
        got: int = self._f.readinto(view)
        if got:
            self._hash.update(view[:got] if got < len(view) else view)
        return got

    def seek(self, pos: int, whence: int = os.SEEK_SET) -> int:
        if whence != os.SEEK_SET or pos < self.tell():
            raise ValueError(f"a hashing reader only moves forward (at {self.tell()}, asked for {pos})")
        self._skip(pos - self.tell())
        return self.tell()

    def _skip(self, n: int | None) -> None:
        """Read and hash `n` more bytes, or up to the end of the file when None."""
        while n is None or n > 0:
            chunk = self._f.read(_READ_CHUNK if n is None else min(n, _READ_CHUNK))
            if not chunk:
                return
            self._hash.update(chunk)
            if n is not None:
                n -= len(chunk)

    def finish(self) -> tuple[int, str]:
        self._skip(None)
        return self._hash.size, self._hash.hexdigest()

    def close(self) -> None:
        self._hash.__exit__(None, None, None)
        self._f.close()

    def __enter__(self) -> HashingReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def hash_file(loc: Location, path: str, algorithm: str = DEFAULT_ALGORITHM) -> tuple[int, str]:
    """(size, digest hex under `algorithm`) of the file's actual bytes; the next chunk is read
    while the last one is hashed (see `HashingReader`)."""
    with HashingReader(open_read(loc, path, prefetch=True), algorithm) as reader:
        return reader.finish()


def check_small(where: str, size: int, limit: int) -> None:
    """Refuse a small file (a manifest, a state file) of more than `limit` bytes before reading it."""
    if size > limit:
        raise StorageError(f"{where} is {size} bytes, more than the {limit} allowed for this file; "
                              "it is not a file this harness wrote")


def read_bytes(loc: Location, path: str, limit: int) -> bytes:
    """A small file's bytes; refuses files over `limit` (a manifest is never megabytes)."""
    check_small(loc.url_of(path), loc.fs.size(path), limit)
    with open_read(loc, path) as f:
        data: bytes = f.read()
        return data
