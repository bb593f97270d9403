"""The fork server's messages: one JSON object per datagram of a unix SOCK_SEQPACKET connection,
file descriptors beside it (SCM_RIGHTS).

One connection per child, in this order:
  client -> server  {"args": [...], "env": {...}, "cwd": str, "new_session": bool}  fds: stdin, stdout, stderr
  server -> client  {"pid": int}  fds: a pidfd of the child (signals reach it, and only it, even once it is gone)
                    or {"refused": reason}, and the connection ends (the client runs a fresh interpreter)
  server -> client  {"returncode": int}  when the server has reaped the child (negative: killed by that signal)
"""

from __future__ import annotations

import json
import socket
from typing import Any

# A request carries the child's environment: far below this on any machine seen. A datagram must
# fit the socket's send buffer (about 200 KiB by default); a larger request is not sent at all.
MAX_MESSAGE = 64 << 10


class TooLarge(ValueError):
    pass


def send(sock: socket.socket, message: dict[str, Any], fds: list[int] = ()) -> None:
    data = json.dumps(message).encode()
    if len(data) > MAX_MESSAGE:
        raise TooLarge(f"fork server message of {len(data)} bytes (at most {MAX_MESSAGE})")
    socket.send_fds(sock, [data], list(fds))


def receive(sock: socket.socket, max_fds: int = 0) -> tuple[dict[str, Any] | None, list[int]]:
    """The next message and the fds that came with it; (None, []) when the peer closed."""
    data, fds, _flags, _addr = socket.recv_fds(sock, MAX_MESSAGE, max_fds)
    if not data:
        for fd in fds:
            socket.close(fd)
        return None, []
    return json.loads(data), fds
