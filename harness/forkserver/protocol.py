"""The fork server's messages: one JSON object per datagram of a unix SOCK_SEQPACKET connection,
file descriptors beside it (SCM_RIGHTS).

One connection per child, in this order:
  client -> server  {"main": [...], "args": [...], "env": {...}, "cwd": str, "new_session": bool}
                    main: what the interpreter is told to run, ["-m", one of MODULES] or [a script's absolute path]
                    fds: stdin, stdout, stderr, and from a relay (relay.py) a fourth, its lifeline: the
                    read end of a pipe whose write end the relay alone holds (the child dies when it closes)
  server -> client  {"pid": int}  fds: a pidfd of the child (signals reach it, and only it, even once it is gone)
                    or {"refused": reason}, and the connection ends (the client runs a fresh interpreter)
  server -> client  {"returncode": int}  when the server has reaped the child (negative: killed by that signal)

`ask` is a client's side of the first two messages.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Sequence
from typing import Any

# A request carries the child's environment: far below this on any machine seen. A datagram must
# fit the socket's send buffer (about 200 KiB by default); a larger request is not sent at all.
MAX_MESSAGE = 64 << 10
# A server answers once its imports are done: seconds, minutes on a loaded machine.
REPLY_TIMEOUT_S = 300
UNSERVABLE = 3  # the server's exit code when it cannot fork safely: its clients start fresh interpreters
# The modules a server runs, as `python -m MODULE ARGS` would: the harness, and torchrun's launcher
# (whose workers, `harness` processes, relay to the server named in their environment: relay.py).
# It runs any script too, as `python SCRIPT ARGS` would (the tests' rank workers).
MODULES = ("harness.cli", "torch.distributed.run")


class TooLarge(ValueError):
    pass


def send(sock: socket.socket, message: dict[str, Any], fds: Sequence[int] = ()) -> None:
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


def ask(path: str, request: dict[str, Any], fds: list[int]) -> tuple[socket.socket, int, int] | str:
    """Ask the server listening at `path` for a child: (the connection, on which its exit code will
    come; the child's pid; a pidfd of it), or the server's reason for refusing. Raises TooLarge
    (nothing was sent) and OSError (no server there, or it ended the connection without a reply,
    or none came within REPLY_TIMEOUT_S)."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        conn.connect(path)
        send(conn, request, fds)
        conn.settimeout(REPLY_TIMEOUT_S)
        reply, pidfds = receive(conn, max_fds=1)
    except BaseException:
        conn.close()
        raise
    if reply is not None and "refused" in reply:
        conn.close()
        reason: str = reply["refused"]
        return reason
    if reply is None or len(pidfds) != 1:
        for fd in pidfds:
            socket.close(fd)
        conn.close()
        raise ConnectionError("the fork server ended the connection without a reply")
    conn.settimeout(None)
    return conn, reply["pid"], pidfds[0]
