"""A fault-injecting HTTP proxy on loopback, in front of a test S3 server.

`FaultProxy(upstream).start()` listens on 127.0.0.1:PORT in a background thread with its own event
loop and forwards each HTTP/1.1 request to `upstream` (one upstream connection per request,
`Connection: close`, so framing upstream is trivial), keeping the client's connection alive the way
botocore expects. Per request it may instead inject one fault:

    slowdown503  503 with S3's `SlowDown` error body (throttling), request not forwarded
    error500     500 `InternalError`, request not forwarded
    forbidden403 403 `AccessDenied`, request not forwarded (a permanent error)
    reset        TCP reset before forwarding (the server never sees the request)
    stall        read the request and never answer (until the proxy stops)
    delay        wait `delay_s`, then forward normally
    truncate     forward, then send the headers and only half the body and close (cut download)

Which fault a request gets comes from `script` (explicit faults for the next requests, in order)
first, then from `plan` (a seeded random fraction). `truncate` only bites on a response with a
body, so the random plan applies it to GETs only. Counters: `seen` counts every request by
(method, path) before any fault, `faults` counts injected faults by mode.

Request bodies are forwarded byte for byte (Content-Length or chunked); `Expect: 100-continue` is
answered by the proxy itself and stripped, since the upstream connection is ours alone.
"""

from __future__ import annotations

import asyncio
import random
import socket
import struct
import threading
from collections import Counter
from dataclasses import dataclass, field
from urllib.parse import urlsplit

TRANSIENT_MODES = ("slowdown503", "error500", "reset", "truncate", "delay")

_ERRORS = {
    "slowdown503": (503, "Service Unavailable", "SlowDown", "Please reduce your request rate."),
    "error500": (500, "Internal Server Error", "InternalError", "We encountered an internal error. Please try again."),
    "forbidden403": (403, "Forbidden", "AccessDenied", "Access Denied"),
}


@dataclass
class FaultPlan:
    """Fault a seeded random `rate` of requests with a mode drawn from `modes`."""

    rate: float = 0.0
    modes: tuple[str, ...] = TRANSIENT_MODES
    seed: int = 0
    _rng: random.Random = field(init=False, repr=False)

    def __post_init__(self):
        self._rng = random.Random(self.seed)

    def choose(self, method: str) -> str | None:
        if self._rng.random() >= self.rate:
            return None
        modes = [m for m in self.modes if m != "truncate" or method == "GET"]
        return self._rng.choice(modes) if modes else None


class FaultProxy:
    """HTTP proxy to `upstream` (http://host:port) with per-request fault injection."""

    def __init__(self, upstream: str, plan: FaultPlan | None = None, delay_s: float = 0.2):
        parts = urlsplit(upstream)
        self._upstream = (parts.hostname, parts.port)
        self.plan = plan or FaultPlan()
        self.script: list[str] = []
        self.delay_s = delay_s
        self.seen: Counter[tuple[str, str]] = Counter()
        self.faults: Counter[str] = Counter()
        self.endpoint = ""
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="s3-fault-proxy", daemon=True)
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task] = set()

    # -- control (any thread) --------------------------------------------------------------
    def start(self) -> FaultProxy:
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._serve, "127.0.0.1", 0), self._loop).result()
        port = self._server.sockets[0].getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{port}"
        return self

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._close(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    def total(self, method: str | None = None) -> int:
        with self._lock:
            return sum(n for (m, _), n in self.seen.items() if method in (None, m))

    def reset_counters(self) -> None:
        with self._lock:
            self.seen.clear()
            self.faults.clear()

    def _pick(self, method: str, path: str) -> str | None:
        with self._lock:
            self.seen[(method, path)] += 1
            mode = self.script.pop(0) if self.script else self.plan.choose(method)
            if mode:
                self.faults[mode] += 1
            return mode

    async def _close(self) -> None:
        self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()

    # -- per connection ----------------------------------------------------------------------
    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._tasks.add(asyncio.current_task())
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                method, target, headers = _parse_head(head)
                if headers.get("expect", "").lower() == "100-continue":
                    writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                    await writer.drain()
                body = await _read_body(reader, headers, is_response=False)
                mode = self._pick(method, urlsplit(target).path)
                if not await self._answer(mode, method, head, body, writer):
                    return
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            # Cancelled by stop(): end quietly (asyncio logs a cancelled connection task as an error).
            return
        finally:
            self._tasks.discard(asyncio.current_task())
            writer.transport.abort()

    async def _answer(self, mode, method, head, body, writer) -> bool:
        """Reply to one request, faulted by `mode`; False when the connection must end."""
        if mode in _ERRORS:
            writer.write(_error_response(*_ERRORS[mode], with_body=method != "HEAD"))
            await writer.drain()
            return True
        if mode == "reset":
            writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            return False
        if mode == "stall":
            await asyncio.Event().wait()
        if mode == "delay":
            await asyncio.sleep(self.delay_s)
        status_head, resp_body = await self._forward(method, head, body)
        if mode == "truncate" and len(resp_body) > 1:
            writer.write(status_head + resp_body[: len(resp_body) // 2])
            await writer.drain()
            return False
        writer.write(status_head + resp_body)
        await writer.drain()
        return True

    async def _forward(self, method: str, head: bytes, body: bytes) -> tuple[bytes, bytes]:
        up_reader, up_writer = await asyncio.open_connection(*self._upstream)
        try:
            up_writer.write(_rewrite_head(head, drop=("expect", "connection"), add=b"Connection: close\r\n") + body)
            await up_writer.drain()
            resp_head = await up_reader.readuntil(b"\r\n\r\n")
            status = int(resp_head.split(b" ", 2)[1])
            _, _, headers = _parse_head(resp_head)
            no_body = method == "HEAD" or status in (204, 304) or 100 <= status < 200
            resp_body = b"" if no_body else await _read_body(up_reader, headers, is_response=True)
            add = b""
            if not no_body and "content-length" not in headers and "transfer-encoding" not in headers:
                add = b"Content-Length: %d\r\n" % len(resp_body)
            return _rewrite_head(resp_head, drop=("connection",), add=add), resp_body
        finally:
            up_writer.close()


def _parse_head(head: bytes) -> tuple[str, str, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    first, second = lines[0].split(" ", 2)[:2]
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            k, v = line.split(":", 1)
            headers[k.strip().lower()] = v.strip()
    return first, second, headers


def _rewrite_head(head: bytes, drop: tuple[str, ...], add: bytes) -> bytes:
    lines = head[:-4].split(b"\r\n")
    kept = [lines[0]] + [ln for ln in lines[1:] if ln.split(b":", 1)[0].strip().lower().decode("latin-1") not in drop]
    return b"\r\n".join(kept) + b"\r\n" + add + b"\r\n"


async def _read_body(reader: asyncio.StreamReader, headers: dict[str, str], is_response: bool) -> bytes:
    """The raw body bytes as framed on the wire (chunk framing kept, so it forwards verbatim)."""
    if "chunked" in headers.get("transfer-encoding", "").lower():
        raw = bytearray()
        while True:
            size_line = await reader.readuntil(b"\r\n")
            raw += size_line
            size = int(size_line.split(b";")[0].strip(), 16)
            if size == 0:
                while (trailer := await reader.readuntil(b"\r\n")) != b"\r\n":
                    raw += trailer
                return bytes(raw + b"\r\n")
            raw += await reader.readexactly(size + 2)
    if "content-length" in headers:
        return await reader.readexactly(int(headers["content-length"]))
    return await reader.read() if is_response else b""


def _error_response(status: int, reason: str, code: str, message: str, with_body: bool) -> bytes:
    body = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}</Message>'
            f"<RequestId>fault-proxy</RequestId></Error>").encode()
    return (f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/xml\r\nContent-Length: {len(body)}\r\n"
            f"\r\n").encode() + (body if with_body else b"")
