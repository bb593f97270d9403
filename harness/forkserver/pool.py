"""Fork servers for whoever starts many `harness` processes (a test session, verify-resume): one
per environment signature, each started when a process first needs it.

Contract: `ForkServers.popen(args, env=..., ...)` returns a Popen for the command line: a
`ForkedPopen` from the server whose signature matches `env` (started then if it is not yet;
at most `limit` servers, each holds some 400 MiB until its children share it), or a plain Popen
(a fresh interpreter) when the command line is not `python -m MODULE ...` of a module a server
runs (protocol.MODULES: the harness's CLI, torchrun's launcher), no server could fork safely
there (OMP_NUM_THREADS other than 1, or elsewhere than on Linux: `servable`; none is started),
or every server's place is taken by another signature. Where a server matches, the
process's environment names it (relay.SERVER_ENV, unless `env` sets that itself), so the `harness`
processes that it starts in turn as fresh interpreters (torchrun's workers, a supervisor's
children) relay to the same server.
`close()` ends the servers and removes their sockets; processes they started run on.

`popen_for(env, cwd)`: what verify-resume starts its runs with: the popen of the server `env`
names (the test session's), else of a pool for the length of a block where `env` lets a server
fork, else `subprocess.Popen`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harness.forkserver.client import ForkServer, NamedServer, served
from harness.forkserver.inherited_env import signature
from harness.forkserver.relay import SERVER_ENV

if TYPE_CHECKING:
    from subprocess import _CMD  # what Popen runs

# Linux only: pidfds (Linux 5.3, Python 3.9) and SOCK_SEQPACKET unix sockets; elsewhere every
# process starts fresh.
SUPPORTED = sys.platform.startswith("linux") and hasattr(os, "pidfd_open")


def servable(env: Mapping[str, str]) -> bool:
    """Whether a server started with `env` could fork: on this platform and with one OpenMP thread
    (otherwise torch's import starts an OpenMP pool, and the server could only exit UNSERVABLE,
    after paying for its imports)."""
    return SUPPORTED and env.get("OMP_NUM_THREADS") == "1"


class ForkServers:
    def __init__(self, cwd: str | Path, limit: int = 2):
        self.cwd = Path(cwd)
        self.limit = limit
        self._servers: dict[str, ForkServer] = {}
        # Short: a unix socket's path has at most 107 bytes.
        self.folder = Path(tempfile.mkdtemp(prefix="harness-fs-"))

    def popen(self, args: _CMD, *, env: Mapping[str, str] | None = None, **kwargs: Any) -> subprocess.Popen[Any]:
        env = dict(os.environ if env is None else env)
        server = self.server_for(env)
        if server is not None:
            env.setdefault(SERVER_ENV, server.socket_path)  # unless the caller chose (an empty value: none)
        if server is None or served(args) is None:
            return subprocess.Popen(args, env=env, **kwargs)
        return server.popen(args, env=env, **kwargs)

    def server_for(self, env: Mapping[str, str]) -> ForkServer | None:
        """The server for `env`'s signature (started now if it is not yet), or None where there is
        none (not `servable`, every place taken, or it found it cannot serve)."""
        if not servable(env):
            return None
        key = json.dumps(signature(env))
        if key not in self._servers and len(self._servers) < self.limit:
            self._servers[key] = ForkServer(env, self.cwd, self.folder, name=str(len(self._servers)))
        server = self._servers.get(key)
        return None if server is None or server.unservable() else server

    def close(self) -> None:
        for server in self._servers.values():
            server.close()
        self._servers.clear()
        shutil.rmtree(self.folder, ignore_errors=True)


@contextmanager
def popen_for(env: Mapping[str, str], cwd: str | Path) -> Iterator[Callable[..., subprocess.Popen[Any]]]:
    """What a command that starts several `harness` processes in turn (verify-resume) starts
    them with: where `env` names a server (relay.SERVER_ENV: the test session's), its `popen`
    (each process forked there, or fresh where it refuses); else a pool's `popen` (closed when
    the block ends) where `env` is `servable`, else `subprocess.Popen`."""
    if SUPPORTED and env.get(SERVER_ENV):
        yield NamedServer(env[SERVER_ENV]).popen
        return
    if not servable(env):
        yield subprocess.Popen
        return
    servers = ForkServers(cwd)
    try:
        yield servers.popen
    finally:
        servers.close()
