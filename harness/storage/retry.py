"""Retries for storage calls: which errors are transient, how long to keep trying, what to tell
the user when it is not worth trying again.

Contract of `call_with_retries(fn, what=, policy=, target=, endpoint=)`:

* `fn` (a coroutine function, one storage request or one read) is awaited until it succeeds, at
  most `policy.attempts` times, with exponential backoff and full jitter between attempts
  (`initial` doubling up to `max_wait`), and never past `policy.deadline_s` in total: each
  attempt is cancelled when the operation's deadline is reached, so a server that accepts the
  connection and never answers fails in bounded time instead of hanging the trainer.
* Only transient errors are retried (`is_transient`): timeouts, connection resets and refusals,
  truncated bodies, HTTP 500/502/503/504/429 and S3's SlowDown/Throttling/RequestTimeout codes.
* Access denied, bad credentials and a missing bucket raise `StorageError` at once, after one
  request, with a message that says what to fix. Other permanent errors (a missing key is
  `FileNotFoundError`, which callers rely on) propagate unchanged.
* Running out of attempts or time on transient errors raises `StorageUnavailable` naming the
  operation, the object, the endpoint, the attempts, the time spent and the last error. It is
  not a `StorageError` (not a `UserError`): no caller may read an outage
  as a missing or malformed file, and the CLI exits with the retryable STORAGE_UNAVAILABLE (69).

Nested calls (a read that wraps a request that is itself retried) retry only at the outermost
level, so attempts do not multiply. Messages never contain credentials: only the operation,
bucket/key, endpoint and the server's error code.
"""

from __future__ import annotations

import asyncio
import contextvars
import errno
import random
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import aiohttp
from botocore import exceptions as bx
from botocore.parsers import ResponseParserError
from tenacity import AsyncRetrying, RetryCallState, RetryError, retry_if_exception, stop_after_attempt, stop_after_delay

from harness.errors import StorageError, Unavailable
from harness.log import get_logger

log = get_logger(__name__)
T = TypeVar("T")

TRANSIENT_CODES = frozenset({
    "SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "RequestTimeTooSkewed",
    "InternalError", "ServiceUnavailable", "RequestLimitExceeded", "TooManyRequests", "BadGateway",
    "GatewayTimeout", "500", "502", "503", "504", "429",
})
TRANSIENT_STATUS = frozenset({429, 500, 502, 503, 504})
DENIED_CODES = frozenset({"AccessDenied", "403", "Forbidden", "AllAccessDisabled", "AccountProblem"})
BAD_CREDENTIAL_CODES = frozenset({"InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken",
                                  "ExpiredToken", "TokenRefreshRequired", "InvalidSecurity"})
TRANSIENT_ERRNOS = frozenset({errno.ECONNRESET, errno.ETIMEDOUT, errno.ECONNREFUSED, errno.ECONNABORTED,
                              errno.EPIPE, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ENETRESET})

# Failures of the connection or of the bytes in flight, not of the request: worth another try.
# A response that does not parse is one too: throttling front ends can send garbled XML.
NETWORK_ERRORS = (bx.HTTPClientError, bx.ConnectionError, bx.IncompleteReadError, bx.ResponseStreamingError,
                  ResponseParserError, aiohttp.ClientConnectionError, aiohttp.ClientPayloadError,
                  aiohttp.ServerTimeoutError, asyncio.TimeoutError, TimeoutError, ConnectionError)

_in_retry = contextvars.ContextVar("harness_storage_in_retry", default=False)


class StorageUnavailable(Unavailable):
    """A storage operation kept failing transiently (timeouts, refused connections, 5xx) until its
    retry deadline; the message names the operation, the object and the endpoint."""


@dataclass(frozen=True)
class RetryPolicy:
    """How hard to try one storage operation (one request, or one read of an object's bytes).

    attempts: at most this many tries (>= 1). initial / max_wait: the backoff ceiling starts at
    `initial` seconds and doubles up to `max_wait`; each wait is uniform in [0, ceiling] (full
    jitter, so many writers hitting a throttled bucket spread out). deadline_s: total time for the
    operation, attempts and waits together; an attempt still running at the deadline is cancelled.
    """

    attempts: int = 8
    initial: float = 0.2
    max_wait: float = 5.0
    deadline_s: float = 120.0

    def __post_init__(self) -> None:
        if self.attempts < 1 or self.initial <= 0 or self.max_wait < self.initial or self.deadline_s <= 0:
            raise StorageError(
                f"invalid storage retry policy {self}: need attempts >= 1, 0 < initial <= max_wait and "
                "deadline_s > 0 (checkpoint.storage_options.retry)")


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """`exc` and the exceptions it was raised from (s3fs wraps botocore's errors in OSError)."""
    seen = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def _client_error(exc: BaseException) -> tuple[str, int | None] | None:
    """(code, HTTP status) of the S3 error response behind `exc`, or None if there was none."""
    for e in _chain(exc):
        response = getattr(e, "response", None)
        if isinstance(response, dict) and "Error" in response:
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            return str(response["Error"].get("Code", "")), status
    return None


def is_transient(exc: BaseException) -> bool:
    """True if trying the same request again may succeed (see the module docstring)."""
    if isinstance(exc, (StorageError, StorageUnavailable)):  # a verdict already: retrying multiplies it
        return False
    client = _client_error(exc)
    if client is not None:
        code, status = client
        return code in TRANSIENT_CODES or status in TRANSIENT_STATUS
    for e in _chain(exc):
        if isinstance(e, bx.FlexibleChecksumError):
            return False
        if isinstance(e, NETWORK_ERRORS):
            return True
        if isinstance(e, OSError) and e.errno in TRANSIENT_ERRNOS:
            return True
    return False


def permanent_error(exc: BaseException, target: str, endpoint: str | None) -> StorageError | None:
    """A `StorageError` saying what to fix for access/credential/bucket errors, else None."""
    where = f" at {endpoint}" if endpoint else ""
    if any(isinstance(e, (bx.NoCredentialsError, bx.PartialCredentialsError)) for e in _chain(exc)):
        return StorageError(f"no credentials for {target}{where}: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
                            "or AWS_PROFILE with ~/.aws/credentials (or run where an instance role provides them)")
    client = _client_error(exc)
    if client is None:
        return None
    code, status = client
    bucket = target.removeprefix("s3://").split("/", 1)[0]
    if code == "NoSuchBucket":
        return StorageError(f"bucket {bucket!r} does not exist{where}: create it, or fix run_dir / the "
                            f"endpoint (checkpoint.storage_options.endpoint_url) ({target})")
    if code in BAD_CREDENTIAL_CODES:
        return StorageError(f"the storage server{where} rejected the credentials ({code}) for {target}: check "
                            "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, AWS_PROFILE or ~/.aws/credentials, "
                            "and that they belong to this endpoint")
    if code in DENIED_CODES or status == 403:
        return StorageError(f"access denied to {target}{where} ({code or status}): check the credentials "
                            "(environment, AWS profile or checkpoint.storage_options) and the bucket policy: "
                            "the harness needs to list, read, write and delete under the run dir")
    return None


# Jitter draws from its own generator: tenacity's waits use the global `random`, whose state is
# part of the training state, so a retry would change the run (a resumed run would not be bitwise).
_jitter = random.Random()


def _capped_wait(policy: RetryPolicy) -> Callable[[RetryCallState], float]:
    """Full-jitter exponential backoff, never sleeping past the operation's deadline."""

    def wait(state: RetryCallState) -> float:
        ceiling = min(policy.max_wait, policy.initial * 2 ** (state.attempt_number - 1))
        elapsed = state.seconds_since_start
        assert elapsed is not None  # tenacity waits after an attempt's outcome, which sets it
        return max(0.0, min(_jitter.uniform(0, ceiling), policy.deadline_s - elapsed))

    return wait


async def call_with_retries(fn: Callable[[], Awaitable[T]], *, what: str, policy: RetryPolicy, target: str,
                            endpoint: str | None = None) -> T:
    """Await `fn()` under `policy` (see the module docstring); `what` and `target` name the
    operation and the object in messages and logs."""
    if _in_retry.get():
        return await fn()
    token = _in_retry.set(True)
    start = time.monotonic()

    def log_retry(state: RetryCallState) -> None:
        assert state.outcome is not None  # tenacity calls before_sleep after a failed attempt
        err = state.outcome.exception()
        log.warning("storage retry", op=what, target=target, attempt=state.attempt_number,
                    error=f"{type(err).__name__}: {err}"[:300])

    async def attempt_once() -> T:
        remaining = policy.deadline_s - (time.monotonic() - start)
        return await asyncio.wait_for(fn(), timeout=max(remaining, 1e-3))

    retrying = AsyncRetrying(stop=stop_after_attempt(policy.attempts) | stop_after_delay(policy.deadline_s),
                             wait=_capped_wait(policy), retry=retry_if_exception(is_transient),
                             before_sleep=log_retry)
    try:
        return await retrying(attempt_once)
    except RetryError as e:
        last = e.last_attempt.exception()
        raise StorageUnavailable(
            f"storage endpoint {endpoint or '(the default AWS endpoint)'} unavailable: {what} {target} failed "
            f"after {e.last_attempt.attempt_number} attempts in {time.monotonic() - start:.1f}s (last error: "
            f"{type(last).__name__}: {last}); the run is consistent on storage and resumes when started again "
            f"once the endpoint answers (or give it more time with checkpoint.storage_options.retry: attempts, "
            f"deadline_s)") from last
    except Exception as e:
        fix = permanent_error(e, target, endpoint)
        if fix is None:
            raise
        raise fix from e
    finally:
        _in_retry.reset(token)
