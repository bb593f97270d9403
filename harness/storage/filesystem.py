"""The fsspec filesystem for a run dir or data URL: `open_filesystem(url, storage_options)`.

The one place a URL becomes a filesystem, so every store gets the same treatment:
* `s3://` (and `s3a://`): a `RetryingS3FileSystem` (s3.py, imported only then) whose every request
  goes through the harness's retry policy. Anything that opens the run dir must come here: plain
  fsspec would pass the `retry` option on to botocore and let botocore's jitter draw from the
  global `random`, which is training state.
* Local paths: a `LocalDiskFileSystem`, fsspec's local filesystem plus the durability calls of the
  commit protocol (fsync of a file and of a folder, atomic rename, exclusive create), so every
  storage operation of every store goes through the filesystem object. It takes no storage
  options: any given (other than `faults`) are ignored with a warning, once per process.
* Other protocols (`memory://`, ...): fsspec's own; they have no transient errors worth retrying.

That makes the filesystem the seam of the fault layer (faults.py): `faults` in the storage
options, or the `HARNESS_FAULTS` environment variable (a debug option, never set by default),
wraps it in a `FaultyFileSystem`.
"""

from __future__ import annotations

import functools
import os
import shutil
from io import BufferedWriter
from typing import IO, Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from harness.log import get_logger
from harness.storage import direct_io

log = get_logger(__name__)

S3_PROTOCOLS = ("s3", "s3a")
FAULTS_ENV = "HARNESS_FAULTS"


def open_filesystem(url: str, storage_options: dict[str, Any] | None = None) -> tuple[Any, str]:
    """(filesystem, path inside it) for `url`; raises ValueError/ImportError like fsspec."""
    options = dict(storage_options or {})
    faults = options.pop("faults", None) or os.environ.get(FAULTS_ENV)
    protocol = str(url).split("://", 1)[0] if "://" in str(url) else ""
    fs: Any  # an fsspec filesystem (untyped), or a FaultyFileSystem over one
    if protocol in S3_PROTOCOLS:
        from harness.storage.s3 import RetryingS3FileSystem, s3_storage_options

        fs = RetryingS3FileSystem(**s3_storage_options(options))
        path = fs._strip_protocol(str(url))
    else:
        fs, path = fsspec.core.url_to_fs(str(url), **options)
        if type(fs) is LocalFileSystem:
            fs = LocalDiskFileSystem()
            if options:
                _warn_ignored_options(tuple(sorted(options)), str(url))
    if faults:
        from harness.storage.faults import wrap_filesystem  # debug only: not imported otherwise
        fs = wrap_filesystem(fs, faults)
    return fs, path


@functools.cache
def _warn_ignored_options(names: tuple[str, ...], url: str) -> None:
    # A warning, not an error: data sources inherit data.storage_options, so a local source
    # beside an S3 one gets the S3 source's options with no way to opt out.
    log.warning("storage options ignored: a local path takes none (they are for remote stores such as s3://)",
                options=list(names), path=url)


class LocalDiskFileSystem(LocalFileSystem):  # type: ignore[misc]  # fsspec has no type information
    """Local disk with the calls a crash-safe commit needs; `open` returns plain Python files
    (unbuffered for reading, so large reads go straight into a tensor's storage)."""

    local_disk = True

    def open(self, path: str, mode: str = "rb", *, direct: bool = False, **kwargs: Any) -> Any:  # Python's or fsspec's
        """`direct`: a large file written once, around the page cache where `writes_direct` says
        so (`mode` "wb"; direct_io.py)."""
        if "b" not in mode or kwargs:
            return super().open(path, mode, **kwargs)
        path = self._strip_protocol(path)
        if direct and mode == "wb" and self.writes_direct(path):
            return direct_io.DirectWriter(path)
        return open(path, mode, buffering=0) if "r" in mode else open(path, mode)

    def writes_direct(self, path: str) -> bool:
        """Whether `open(path, "wb", direct=True)` writes around the page cache (direct_io.suits)."""
        return direct_io.suits(os.path.dirname(self._strip_protocol(path)) or ".")

    def fsync(self, f: IO[Any]) -> None:
        """Flush `f` (a file from `open`) and make its bytes durable."""
        f.flush()
        os.fsync(f.fileno())

    def fsync_dir(self, path: str) -> None:
        """Make the creations, renames and removals inside folder `path` durable."""
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def replace(self, src: str, dst: str) -> None:
        """Atomic rename (over an existing file, or an empty folder)."""
        os.replace(src, dst)

    def create_new(self, path: str) -> BufferedWriter:
        """A writable file at `path` that did not exist; `FileExistsError` if it did (O_EXCL)."""
        return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644), "wb")

    def remove_tree(self, path: str) -> None:
        """Remove a folder and everything in it; what is already gone is not an error."""
        shutil.rmtree(path, ignore_errors=True)
