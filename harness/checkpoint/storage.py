"""Where checkpoint bytes go: an fsspec filesystem plus the durability rules for each kind.

`open_location(url)` turns a local path or any fsspec URL into a `Location`. Writes differ by
kind on purpose:

* Local disk: files are written and fsynced, folders are fsynced after a rename, so a power loss
  after `commit` returns cannot lose or tear the checkpoint. Every local operation is a method of
  the `LocalDiskFileSystem` (filesystem.py), never a bare `os` call, so the fault layer sees it.
* Object stores and `memory://`: a single PUT is atomic and there is nothing to fsync; the
  commit point is the manifest object, written last (see store.py).

`write_stream` hashes what it writes in a second thread, behind the writes and during the fsync:
sha256 runs at about 1.3 GB/s here, a disk at a few hundred MB/s, so the hash is free when
overlapped and would cost 15-50% of the save when done in line. hashlib and file writes both
release the GIL.
"""

from __future__ import annotations

import hashlib
import itertools
import os
from collections.abc import Iterable
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from harness.checkpoint.errors import CheckpointError
from harness.checkpoint.filesystem import open_filesystem

# Written-but-not-yet-hashed bytes allowed in flight; see write_stream.
_HASH_BACKLOG_BYTES = 512 << 20
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


def open_location(url: str, storage_options: dict | None = None) -> Location:
    """Resolve `url` (local path or fsspec URL); an unknown protocol is a `CheckpointError`."""
    try:
        fs, root = open_filesystem(str(url), storage_options)
    except ValueError as e:
        protocol = str(url).split("://", 1)[0]
        raise CheckpointError(
            f"unknown storage protocol {protocol!r} in {url!r}: use a local path or an fsspec URL "
            f"such as s3://bucket/prefix or memory://name ({e})"
        ) from e
    except ImportError as e:
        raise CheckpointError(f"storage URL {url!r} needs a package that is not installed: {e}") from e
    if getattr(fs, "local_disk", False):
        root = os.path.abspath(root)
    return Location(fs=fs, root=root.rstrip("/") or "/", url=str(url))


def fsync_dir(loc: Location, path: str) -> None:
    """Make a rename or file creation inside local folder `path` durable."""
    loc.fs.fsync_dir(path)


def rename(loc: Location, src: str, dst: str) -> None:
    """Atomically rename `src` to `dst` on local disk (not durable until `fsync_dir` of the parent)."""
    loc.fs.replace(src, dst)


def write_stream(loc: Location, path: str, chunks: Iterable[memoryview | bytes]) -> tuple[int, str]:
    """Write `chunks` to `path`, durably on local disk; return (size, sha256 hex).

    The hash runs behind the writes and finishes during the fsync; at most
    `_HASH_BACKLOG_BYTES` of written-but-unhashed chunks are kept alive (a chunk may be a CPU
    copy of a GPU tensor, so an unbounded backlog could hold the whole state twice).
    """
    digest = hashlib.sha256()
    size = 0
    backlog: deque[tuple[Future, int]] = deque()
    pending = 0
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-hash") as hasher:
        with loc.fs.open(path, "wb") as f:
            for chunk in chunks:
                n = len(chunk) if isinstance(chunk, bytes) else chunk.nbytes
                backlog.append((hasher.submit(digest.update, chunk), n))
                pending += n
                f.write(chunk)
                size += n
                while pending > _HASH_BACKLOG_BYTES:
                    done, n_done = backlog.popleft()
                    done.result()
                    pending -= n_done
            if loc.is_local:
                loc.fs.fsync(f)
        for done, _ in backlog:
            done.result()
    return size, digest.hexdigest()


def write_small(loc: Location, path: str, data: bytes) -> None:
    """Write a small file whole (a manifest, a lease); durable on local disk."""
    write_stream(loc, path, [data])


def open_read(loc: Location, path: str, prefetch: bool = False):
    """A binary reader with `seek` and `readinto`; unbuffered on local disk (large reads go
    straight into the destination tensor). `prefetch` asks the kernel to read the whole file
    ahead asynchronously (into the page cache, not this process's memory): loading reads every
    tensor in order, and without it each tensor-sized read waits for the disk on its own."""
    f = loc.fs.open(path, "rb")
    if loc.is_local and prefetch and hasattr(os, "posix_fadvise"):
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_WILLNEED)
    return f


def hash_file(loc: Location, path: str) -> tuple[int, str]:
    """(size, sha256 hex) of the file's actual bytes, read in chunks.

    Two buffers: the next chunk is read while a worker thread hashes the last one (hashlib
    releases the GIL), so verifying a checkpoint costs about the read, not read + hash, which
    is what a resume waits for before loading."""
    digest = hashlib.sha256()
    size = 0
    views = [memoryview(bytearray(_READ_CHUNK)) for _ in range(2)]
    hashing: Future | None = None
    with open_read(loc, path) as f, ThreadPoolExecutor(1, thread_name_prefix="hash") as pool:
        for i in itertools.count():
            view = views[i % 2]  # the other buffer may still be hashing; this one is free
            n = f.readinto(view)
            if hashing is not None:
                hashing.result()
            if not n:
                break
            hashing = pool.submit(digest.update, view[:n])
            size += n
    return size, digest.hexdigest()


def read_bytes(loc: Location, path: str, limit: int) -> bytes:
    """A small file's bytes; refuses files over `limit` (a manifest is never megabytes)."""
    size = loc.fs.size(path)
    if size > limit:
        raise CheckpointError(f"{loc.url_of(path)} is {size} bytes, more than the {limit} allowed for this file; it is not a file this harness wrote")
    with open_read(loc, path) as f:
        return f.read()
