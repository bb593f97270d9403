"""S3 through s3fs with the harness's retry policy: the filesystem `open_filesystem` returns for `s3://`.

Every S3 request and every read of an object's bytes goes through `retry.call_with_retries`, and
the retry loops of botocore and s3fs are switched off so that a permanent error costs exactly one
request and the policy's deadline really bounds an operation.

S3 storage options are s3fs's (`endpoint_url`, `key`, `secret`, `token`, `profile`,
`client_kwargs = {region_name = ...}`, `config_kwargs`, ...) plus `retry`, a table of
`RetryPolicy` fields (attempts, initial, max_wait, deadline_s). Credentials come from the usual
places (AWS_* environment variables, AWS_PROFILE and ~/.aws, or `key`/`secret` here); this module
never logs or stores them.

A write that fails part-way aborts its multipart upload (s3fs would otherwise complete it with the
parts it has on `close()`), so no orphan uploads are left to be billed.

Imported only when a run dir or data URL is on S3: s3fs and aiobotocore take a second to import.
"""

from __future__ import annotations

import asyncio
import io
import os
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from types import TracebackType
from typing import Any, TypeVar, cast

from fsspec.asyn import sync, sync_wrapper
from s3fs import S3FileSystem
from s3fs.core import S3File, _inner_fetch

from harness.log import get_logger
from harness.storage.retry import RetryPolicy, call_with_retries

log = get_logger(__name__)

T = TypeVar("T")

# Per-request socket timeouts: a stalled request becomes a retryable timeout well within the
# operation's deadline. 60 s of read silence is generous even for a 5 GiB part.
CONNECT_TIMEOUT_S = 10
READ_TIMEOUT_S = 60
# Parts of one object uploading at once: enough to keep several connections busy (one S3
# connection tops out far below a node's bandwidth), few enough to bound the memory they hold.
PARTS_IN_FLIGHT = 4
# Read-ahead block of a reader: large reads stream straight into tensors, so bigger is faster
# (loading 256 MiB from moto: 115 MiB/s at 16 MiB, 72 MiB/s at 8 MiB).
BLOCK_SIZE = 16 << 20
# Multipart part size of a writer, at most the block size: boto3's transfer-manager default.
# Against moto, 4 parts in flight, 8 MiB parts uploaded at 117-127 MiB/s, 16 MiB parts at
# 88-99 MiB/s (docs/bench-s3.md). S3 allows 10,000 parts per object, so the part size doubles
# every `PARTS_PER_SIZE` parts: 8 GiB of 8 MiB parts, then 16 GiB of 16 MiB parts, ...; 10,000
# parts then hold 8 TiB.
PART_SIZE = 8 << 20
PARTS_PER_SIZE = 1000
# The checksum each multipart part carries and the completed object is checked against: CRC32,
# boto3's default (see `_RetryingS3File._declares_checksums`).
MULTIPART_CHECKSUM = "CRC32"


def s3_storage_options(user_options: dict[str, Any] | None) -> dict[str, Any]:
    """s3fs keyword arguments: the user's options over the harness defaults (no botocore retries,
    bounded socket timeouts), with `retry` turned into a `RetryPolicy`."""
    options = dict(user_options or {})
    policy = RetryPolicy(**options.pop("retry", {}))
    config_kwargs = {"connect_timeout": CONNECT_TIMEOUT_S, "read_timeout": READ_TIMEOUT_S,
                     **options.pop("config_kwargs", {})}
    # botocore sha256-signs every body sent over plain http (a local MinIO, moto) on the event
    # loop that sends it: a third of that loop's time in an upload, measured. Over https it
    # already sends uploads unsigned, relying on the CRC32 checksum header the server verifies;
    # this makes http behave the same. The manifest's digest still covers every byte end to end.
    config_kwargs["s3"] = {"payload_signing_enabled": False, **config_kwargs.get("s3", {})}
    # Retries are ours alone: botocore's would multiply attempts and hide a 403 behind several requests.
    config_kwargs["retries"] = {"total_max_attempts": 1, "mode": "standard"}
    return {"default_block_size": BLOCK_SIZE, **options, "config_kwargs": config_kwargs, "retry_policy": policy}


class RetryingS3FileSystem(S3FileSystem):  # type: ignore[misc]  # s3fs has no type information
    """s3fs with `RetryPolicy` around each request (`_call_s3`) and each byte read."""

    retries = 1  # s3fs's own retry loop: one attempt, ours does the rest

    def __init__(self, *args: Any, retry_policy: RetryPolicy | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.retry_policy = retry_policy or RetryPolicy()
        self._lanes: tuple[int, list[RetryingS3FileSystem]] | None = None
        self._lanes_lock = threading.Lock()

    def upload_lane(self, part_number: int) -> RetryingS3FileSystem:
        """The filesystem that uploads part `part_number`: one of `PARTS_IN_FLIGHT` copies of this
        one (same options), each on its own event-loop thread. Every request's CPU work (signing,
        the HTTP framing, copying the body into the socket) runs on the loop that sends it, so
        one shared loop caps an upload at what one core can push; lanes spread the parts over
        threads, as boto3's transfer manager does. Made on first use, again after a fork."""
        with self._lanes_lock:
            return self._lane(part_number)

    def _lane(self, part_number: int) -> RetryingS3FileSystem:
        if self._lanes is None or self._lanes[0] != os.getpid():
            lanes = []
            for i in range(PARTS_IN_FLIGHT):
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, name=f"s3-upload-{i}", daemon=True).start()
                lanes.append(type(self)(*self.storage_args, **self.storage_options, loop=loop,
                                        skip_instance_cache=True))
            self._lanes = (os.getpid(), lanes)
        lanes = self._lanes[1]
        return lanes[part_number % len(lanes)]

    def abort_uploads(self, path: str) -> list[str]:
        """Abort every open multipart upload of an object under `path` (bucket/prefix); returns
        their keys. For the run dir's single writer, right after it takes the lease: an upload
        still open then was left by an earlier writer killed mid-upload, and is billed until
        aborted."""
        bucket, prefix, _ = self.split_path(path)
        prefix = prefix.rstrip("/") + "/"
        aborted = []
        pages = {"IsTruncated": True}
        marker: dict[str, str] = {}
        while pages.get("IsTruncated"):
            pages = self.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix, **marker)
            for upload in pages.get("Uploads", []):
                self.call_s3("abort_multipart_upload", Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])
                aborted.append(upload["Key"])
            marker = {"KeyMarker": pages.get("NextKeyMarker", ""),
                      "UploadIdMarker": pages.get("NextUploadIdMarker", "")}
        return aborted

    async def _retrying(self, fn: Callable[[], Awaitable[T]], what: str, bucket: str, key: str = "") -> T:
        target = f"s3://{bucket}/{key}" if key else f"s3://{bucket}"
        return await call_with_retries(fn, what=what, policy=self.retry_policy, target=target,
                                       endpoint=self.endpoint_url)

    async def _call_s3(self, method: str, *akwarglist: Any, **kwargs: Any) -> dict[str, Any]:
        parent = super()._call_s3
        response: dict[str, Any] = await self._retrying(lambda: parent(method, *akwarglist, **kwargs), f"S3 {method}",
                                                        kwargs.get("Bucket", ""), kwargs.get("Key", ""))
        return response

    call_s3 = sync_wrapper(_call_s3)

    async def _cat_file(self, path: str, *args: Any, **kwargs: Any) -> bytes:
        bucket, key, _ = self.split_path(path)
        parent = super()._cat_file
        data: bytes = await self._retrying(lambda: parent(path, *args, **kwargs), "read", bucket, key)
        return data

    def _open(self, path: str, mode: str = "rb", *args: Any, **kwargs: Any) -> _RetryingS3File:
        f = super()._open(path, mode, *args, **kwargs)
        # s3fs builds its S3File by name; switching the class adds retried reads and abort-on-error.
        # A reader's cache holds the fetch method bound at construction, so it is rebound too.
        f.__class__ = _RetryingS3File
        f._parts_in_flight = []  # (upload, its body) while uploading
        if f.writable():
            f._start_writing()
        if f.readable():
            f.cache.fetcher = f._fetch_range
        return cast(_RetryingS3File, f)  # by the class switch above


class _RetryingS3File(S3File):  # type: ignore[misc]  # s3fs has no type information
    """S3File whose range reads are retried whole (request and body), whose writes fill fixed-size
    parts that upload in the background (up to `PARTS_IN_FLIGHT` at once, while the caller keeps
    serializing; sizes double every `PARTS_PER_SIZE` parts), and whose failed writes abort."""

    # S3File's attributes used here (s3fs has no type information).
    blocksize: int
    forced: bool
    closed: bool
    buffer: io.BytesIO | None
    # Ours: the part being filled (None once the file is flushed for good or aborted), and the
    # parts uploading: (the upload, its body), set by `RetryingS3FileSystem._open`.
    _part: bytearray | None
    _parts_in_flight: list[tuple[Future[Any], bytearray]]

    def _start_writing(self) -> None:
        self.blocksize = self._first_part_size = min(self.blocksize, PART_SIZE)
        self._part = bytearray(self.blocksize)
        self._filled = 0
        self._spare: list[bytearray] = []
        self._checksum_kw: dict[str, str] = {}

    def write(self, data: bytes | memoryview) -> int:
        """Copy `data` into the part being filled and ship each part as it fills: one copy of
        every byte (s3fs's own buffering makes three, which a 2-core node pays for in upload
        speed)."""
        if not self.writable() or self.closed or self.forced:
            written: int = super().write(data)  # raises fsspec's error for the case
            return written
        view = memoryview(data).cast("B")
        done = 0
        while done < view.nbytes:
            part = self._part
            assert part is not None  # None only once forced or closed, which the test above rules out
            n = min(view.nbytes - done, len(part) - self._filled)
            part[self._filled:self._filled + n] = view[done:done + n]
            self._filled += n
            self.loc += n
            done += n
            if self._filled == len(part):
                self._ship(part)
        return done

    def flush(self, force: bool = False) -> None:
        """Parts leave as they fill; `force` (from `close`) ships the last one and completes the
        upload, or PUTs a file smaller than one part in a single request."""
        if self.closed:
            raise ValueError("Flush on closed file")
        if not force or self.readable():
            return
        if self.forced:
            raise ValueError("Force flush cannot be called more than once")
        self.forced = True
        assert self._part is not None  # None only once forced or closed
        tail = memoryview(self._part)[:self._filled]
        if self.mpu is None:
            self.buffer = io.BytesIO(tail)  # `commit` PUTs it in one request (or touches an empty file)
        elif self._filled:
            self._ship(bytearray(tail))
        self._part = None
        self._spare.clear()
        self.commit()

    def _ship(self, body: bytearray) -> None:
        """Upload `body` as the next part on an upload lane, starting the multipart upload at the
        first part, and make `self._part` an empty part buffer again. `body` must not change until
        its upload is done (then it is reused: a fresh buffer would cost a zero-fill and a page
        fault per 4 KiB). s3fs records the ETag as a future that `complete_multipart_upload`
        resolves; a failed part raises here (at a later part) or at completion."""
        if self.mpu is None:
            self._initiate_upload()
        while True:
            uploading = []
            for future, sent in self._parts_in_flight:
                if future.done():
                    future.result()
                    self._spare.append(sent)
                else:
                    uploading.append((future, sent))
            self._parts_in_flight = uploading
            if len(uploading) < PARTS_IN_FLIGHT:
                break
            wait([f for f, _ in uploading], return_when=FIRST_COMPLETED)
        number = len(self.parts) + 1
        lane = self.fs.upload_lane(number)
        coro = lane._call_s3("upload_part", self.s3_additional_kwargs, self._request_payer_kw, Bucket=self.bucket,
                             Key=self.key, UploadId=self.mpu["UploadId"], PartNumber=number, Body=body,
                             **self._checksum_kw)
        future = asyncio.run_coroutine_threadsafe(coro, lane.loop)
        self._parts_in_flight.append((future, body))
        self.parts.append({"PartNumber": number, "ETag": future})
        self.blocksize = self._first_part_size << (len(self.parts) // PARTS_PER_SIZE)
        spare = self._spare.pop() if self._spare else None
        self._part = spare if spare is not None and len(spare) == self.blocksize else bytearray(self.blocksize)
        self._filled = 0

    def _call_s3(self, method: str, *kwarglist: Any, **kwargs: Any) -> dict[str, Any]:
        if method == "create_multipart_upload" and self._declares_checksums():
            self._checksum_kw = {"ChecksumAlgorithm": MULTIPART_CHECKSUM}  # for its parts too
            kwargs.update(self._checksum_kw)
        if method == "complete_multipart_upload":
            checksum = f"Checksum{MULTIPART_CHECKSUM}"
            for part in kwargs["MultipartUpload"]["Parts"]:
                if isinstance(part["ETag"], Future):
                    response = part["ETag"].result()
                    part["ETag"] = response["ETag"]
                    if checksum in response:
                        part[checksum] = response[checksum]
        reply: dict[str, Any] = super()._call_s3(method, *kwarglist, **kwargs)
        return reply

    def _declares_checksums(self) -> bool:
        """Whether a multipart upload names its checksum algorithm: boto3's transfer manager does
        under botocore's default `request_checksum_calculation = "when_supported"`, and so do we.
        S3 then requires a CRC32 with every part, checks the completion's list of part checksums
        against the parts it received, and keeps a composite checksum of the object (readable
        with `get_object_attributes`). (Without it moto, the local server, computes a
        whole-object checksum in Python at completion: a sixth of its CPU for an upload.)"""
        declares: bool = self.fs.connect().meta.config.request_checksum_calculation == "when_supported"
        return declares

    def _fetch_range(self, start: int, end: int) -> bytes:
        if start >= end:
            return b""
        fs = self.fs
        fetch = lambda: _inner_fetch(fs, self.bucket, self.key, self.version_id, start, end,  # noqa: E731
                                     self.read_kw, self.details)
        data: bytes = sync(fs.loop, fs._retrying, fetch, "read", self.bucket, self.key)
        return data

    def close(self) -> None:
        try:
            super().close()
        except BaseException:
            self._abort_upload()  # the last part or the completion failed: leave no open upload
            raise

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> bool | None:
        if exc_type is not None and self.writable():
            # close() would upload the part being filled and complete the multipart upload with
            # the parts it has: a torn object. Abort instead; the commit protocol never points at
            # this object.
            self.buffer = self._part = None
            self._abort_upload()
            self.closed = True
            return None
        suppress: bool | None = super().__exit__(exc_type, exc, tb)
        return suppress

    def _abort_upload(self) -> None:
        """Abort the multipart upload, if one is open; a failure to abort is logged, not raised, so
        the error that caused it is the one the caller sees."""
        # Parts still uploading would outlive the abort and stay billed: let them finish first.
        wait([f for f, _ in self._parts_in_flight])
        try:
            self._abort_mpu()
        except Exception as e:
            log.warning("could not abort a failed multipart upload; list and abort it with "
                        "`aws s3api list-multipart-uploads`", target=f"s3://{self.bucket}/{self.key}",
                        error=f"{type(e).__name__}: {e}"[:300])
