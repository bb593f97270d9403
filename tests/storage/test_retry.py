"""retry.py + filesystem.py against a real HTTP S3 endpoint behind the fault proxy: transient faults
are retried and the bytes come back intact; a stall fails within the deadline; a 403 or a missing
bucket costs one request and says what to fix; a failed multipart upload is aborted."""

from __future__ import annotations

import errno
import os
import random
import time

import pytest
from botocore.exceptions import (
    ClientError,
    ConnectionClosedError,
    EndpointConnectionError,
    FlexibleChecksumError,
    ReadTimeoutError,
)
from s3fs.errors import translate_boto_error

from harness.errors import UserError
from harness.storage.filesystem import open_filesystem
from harness.storage.retry import RetryPolicy, StorageError, StorageUnavailable, is_transient
from s3proxy import FaultPlan
from s3server import options


def client_error(code: str, status: int) -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": code}, "ResponseMetadata": {"HTTPStatusCode": status}},
                       "PutObject")


@pytest.mark.parametrize("exc, transient", [
    (client_error("SlowDown", 503), True),
    (client_error("Throttling", 400), True),
    (client_error("RequestTimeout", 400), True),
    (client_error("InternalError", 500), True),
    (client_error("502", 502), True),
    (client_error("ServiceUnavailable", 503), True),
    (client_error("GatewayTimeout", 504), True),
    (translate_boto_error(client_error("SlowDown", 503)), True),  # as s3fs re-raises it
    (EndpointConnectionError(endpoint_url="http://x"), True),
    (ConnectionClosedError(endpoint_url="http://x"), True),
    (ReadTimeoutError(endpoint_url="http://x"), True),
    (TimeoutError(), True),
    (ConnectionResetError(), True),
    (OSError(errno.ETIMEDOUT, "timed out"), True),
    (client_error("AccessDenied", 403), False),
    (translate_boto_error(client_error("AccessDenied", 403)), False),
    (client_error("InvalidAccessKeyId", 403), False),
    (client_error("SignatureDoesNotMatch", 403), False),
    (client_error("NoSuchBucket", 404), False),
    (client_error("404", 404), False),
    (FlexibleChecksumError(error_msg="checksum mismatch"), False),
    (FileNotFoundError("key"), False),
    (StorageError("gave up"), False),
    (StorageUnavailable("gave up"), False),
    (ValueError("bug"), False),
])
def test_classification(exc, transient):
    assert is_transient(exc) is transient


def test_policy_rejects_nonsense():
    with pytest.raises(UserError, match="retry"):
        RetryPolicy(attempts=0)


@pytest.mark.parametrize("mode", ["slowdown503", "error500", "reset", "truncate", "delay"])
def test_transient_faults_are_retried(proxy, s3_url, mode):
    fs, root = open_filesystem(s3_url, options(proxy.endpoint, default_block_size=5 << 20))
    small, big = os.urandom(1000), os.urandom(11 << 20)  # big: a multipart upload (3 parts)
    proxy.plan = FaultPlan(rate=0.5, modes=(mode,), seed=3)
    fs.pipe_file(f"{root}/small", small)
    with fs.open(f"{root}/big", "wb") as f:
        f.write(big[: 6 << 20])
        f.write(big[6 << 20:])
    proxy.script = [mode]  # the GET of a whole object
    assert fs.cat_file(f"{root}/small") == small
    with fs.open(f"{root}/big", "rb") as f:
        proxy.script = [mode]  # the GET of a range, through the file's cache
        assert f.read() == big
    assert proxy.faults[mode] > 0


def test_parts_grow_so_that_s3s_part_limit_is_never_reached(proxy, s3_url, monkeypatch):
    """Part sizes double every PARTS_PER_SIZE parts (S3 allows 10,000 per object)."""
    from harness.storage import s3

    monkeypatch.setattr(s3, "PARTS_PER_SIZE", 2)
    fs, root = open_filesystem(s3_url, options(proxy.endpoint, default_block_size=5 << 20))
    data = os.urandom(40 << 20)
    proxy.reset_counters()
    with fs.open(f"{root}/big", "wb") as f:
        for i in range(0, len(data), 1 << 20):
            f.write(data[i:i + (1 << 20)])
    assert proxy.total("PUT") == 5  # 5 + 5 + 10 + 10 + the last 10 MiB; at a fixed 5 MiB, 8 parts
    assert fs.cat_file(f"{root}/big") == data


def test_stalled_server_fails_within_deadline(proxy, s3_url):
    deadline = 2.0
    fs, root = open_filesystem(s3_url, options(proxy.endpoint, deadline_s=deadline, read_timeout=30))
    proxy.plan = FaultPlan(rate=1.0, modes=("stall",))
    start = time.monotonic()
    with pytest.raises(StorageUnavailable, match=f"storage endpoint {proxy.endpoint} unavailable: S3 put_object"):
        fs.pipe_file(f"{root}/x", b"data")
    assert time.monotonic() - start < deadline + 1.0


@pytest.mark.parametrize("op", ["write", "read", "list"])
def test_access_denied_is_one_request_and_says_what_to_fix(proxy, s3_url, op):
    fs, root = open_filesystem(s3_url, options(proxy.endpoint))
    fs.pipe_file(f"{root}/x", b"data")
    proxy.reset_counters()
    proxy.plan = FaultPlan(rate=1.0, modes=("forbidden403",))
    call = {"write": lambda: fs.pipe_file(f"{root}/y", b"data"), "read": lambda: fs.cat_file(f"{root}/x"),
            "list": lambda: fs.ls(root, refresh=True)}[op]
    with pytest.raises(StorageError, match="access denied to s3://.*check the credentials"):
        call()
    assert proxy.total() == 1


def test_missing_bucket_is_one_request_and_says_what_to_fix(proxy):
    fs, root = open_filesystem("s3://no-such-bucket/run", options(proxy.endpoint))
    with pytest.raises(StorageError, match="bucket 'no-such-bucket' does not exist.*create it"):
        fs.pipe_file(f"{root}/x", b"data")
    assert proxy.total() == 1


def test_failed_multipart_upload_is_aborted(proxy, s3_server, s3_url):
    fs, root = open_filesystem(s3_url, options(proxy.endpoint, attempts=3, default_block_size=5 << 20))
    proxy.script = [None, "error500", "error500", "error500"]  # create the upload, then fail its part
    with pytest.raises(StorageUnavailable, match="upload_part.*after 3 attempts"):
        with fs.open(f"{root}/big", "wb") as f:
            f.write(os.urandom(5 << 20))  # exactly one part
    assert not fs.exists(f"{root}/big")
    assert s3_server.open_multipart_uploads() == []


def test_write_interrupted_by_an_error_is_aborted_not_completed(proxy, s3_server, s3_url):
    fs, root = open_filesystem(s3_url, options(proxy.endpoint, default_block_size=5 << 20))
    with pytest.raises(RuntimeError, match="serializer failed"):
        with fs.open(f"{root}/big", "wb") as f:
            f.write(os.urandom(6 << 20))  # one part uploaded
            raise RuntimeError("serializer failed")
    assert not fs.exists(f"{root}/big")
    assert s3_server.open_multipart_uploads() == []


def test_retries_leave_the_global_python_rng_alone(proxy, s3_url):
    """The global `random` state is training state: backoff jitter must not draw from it."""
    fs, root = open_filesystem(s3_url, options(proxy.endpoint))
    before = random.getstate()
    proxy.script = ["slowdown503", "error500", "reset"]
    fs.pipe_file(f"{root}/x", b"data")
    assert sum(proxy.faults.values()) == 3
    assert random.getstate() == before


def checksum_of(s3_server, root: str, name: str) -> tuple[str, str]:
    """(checksum type, algorithm) the server keeps for object `name` under `root` (bucket/prefix)."""
    attributes = s3_server.client().get_object_attributes(
        Bucket=s3_server.bucket, Key=f"{root.split('/', 1)[1]}/{name}", ObjectAttributes=["Checksum"])
    checksum = attributes.get("Checksum", {})
    algorithms = [k.removeprefix("Checksum") for k in checksum if k != "ChecksumType"]
    return checksum.get("ChecksumType", ""), ",".join(algorithms)


def test_multipart_parts_carry_checksums_the_server_checks(proxy, s3_server, s3_url):
    """Like boto3's transfer manager: the upload names CRC32, every part carries one, and the
    completed object holds the composite checksum of its parts (S3 checks the completion's part
    list against the parts it received)."""
    fs, root = open_filesystem(s3_url, options(proxy.endpoint, default_block_size=5 << 20))
    data = os.urandom(12 << 20)  # 5 + 5 + 2 MiB
    with fs.open(f"{root}/big", "wb") as f:
        f.write(data)
    assert checksum_of(s3_server, root, "big") == ("COMPOSITE", "CRC32")
    assert fs.cat_file(f"{root}/big") == data


def test_without_checksum_calculation_uploads_name_no_algorithm(proxy, s3_server, s3_url):
    """`request_checksum_calculation = "when_required"` (e.g. for a store that rejects checksum
    headers) is honoured for multipart uploads too."""
    fs, root = open_filesystem(s3_url, options(proxy.endpoint, default_block_size=5 << 20, config_kwargs={
        "connect_timeout": 2, "read_timeout": 5, "request_checksum_calculation": "when_required"}))
    data = os.urandom(6 << 20)
    with fs.open(f"{root}/big", "wb") as f:
        f.write(data)
    assert checksum_of(s3_server, root, "big") != ("COMPOSITE", "CRC32")
    assert fs.cat_file(f"{root}/big") == data
