"""The fork server's process: torch and the harness imported once, a forked child per request.

`preload()` imports what a `harness` process imports, after `numerics.prepare_environment()` as
the CLI does, and runs no torch operation: forking is safe only while the process has one
thread, so no OpenMP or intra-op pool, no MKL state and no CUDA context exists yet; it checks
that (a server with more threads exits with `UNSERVABLE`: its clients start fresh
interpreters). `serve()` then answers requests (the messages: harness/forkserver/protocol.py)
until its lifeline (stdin, a pipe from the process that started it) closes. It never installs a
signal handler, nor prints once serving, so a child starts with the interpreter's own start-up
signal dispositions and empty stdio buffers.

Per request: a child that runs neither a module of protocol.MODULES nor a script file, one whose
environment (before the imports) differs from the server's in its `inherited_env.signature` or in
a variable the imports set (other than by asking for the value they set), or one whose first
folder on sys.path (the working folder for `-m`, the script's folder for a script) holds a module
of the name of one the server has imported (a fresh interpreter would import that one), is
refused. Otherwise the server forks; in the child
`serve()` returns the request (every fd of the server's own closed), in the server the child's
pidfd goes to the client and, when the child ends, the server reaps it and sends its exit code.
A client that went away leaves its child running, as a Popen child outlives its parent (a
relay's child dies with its relay: relay.py); the server still reaps it.
"""

from __future__ import annotations

import gc
import importlib
import os
import selectors
import socket
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from harness.forkserver import inherited_env, protocol, relay
from harness.repro import numerics

# What `harness train` imports besides its command module (torch._dynamo comes with torch's
# optimizers): about 6 CPU-seconds per process that every child is spared; and torchrun's
# launcher (0.02 CPU-seconds more once those are in).
PRELOAD = ("torch", "torch._dynamo", "harness.cli", "harness.run.session", "harness.run.trainer",
           "harness.models.gpt", "optim", "torch.distributed.run")

REQUEST_TIMEOUT_S = 30  # a client sends its request right after it connects


@dataclass
class Request:
    main: list[str]  # ["-m", one of protocol.MODULES] or [a script's absolute path]
    args: list[str]  # the arguments after them
    env: dict[str, str]
    cwd: str
    new_session: bool
    fds: list[int]  # stdin, stdout, stderr
    lifeline: int | None  # from a relay: the child dies when its write end closes (parent_death.die_with_relay)


@dataclass
class Preloaded:
    env: dict[str, str]  # the environment before the imports (with the numerics defaults)
    effects: dict[str, str]  # what the imports put into it (torch sets TORCHINDUCTOR_CACHE_DIR)


def preload() -> Preloaded:
    """Import what every child needs. Exits with `UNSERVABLE` if that started a thread: torch's
    import runs an OpenMP parallel region when OMP_NUM_THREADS is not 1, and a forked child of a
    process with a live OpenMP pool hangs in its first parallel region."""
    numerics.prepare_environment()
    relay.disable()  # this process and its children run their commands themselves
    before = dict(os.environ)
    import harness.cli

    for name in (*PRELOAD, *harness.cli.COMMAND_MODULES):
        importlib.import_module(name)
    threads = len(os.listdir("/proc/self/task"))
    if threads != 1:
        print(f"fork server: {threads} threads after the imports; forking would be unsafe", file=sys.stderr)
        sys.exit(protocol.UNSERVABLE)
    if before.keys() - os.environ.keys():
        print(f"fork server: the imports removed {sorted(before.keys() - os.environ.keys())}", file=sys.stderr)
        sys.exit(protocol.UNSERVABLE)
    # The imports' objects out of the collector's reach: a child's collections would otherwise
    # write to every one of them (their headers), copying the server's memory page by page; that
    # took 1 of the 1.4 CPU-seconds of a forked `harness ckpt --help`. They live as long as the
    # child anyway (modules); the cost is cycles among them that the child drops, never freed.
    gc.freeze()
    return Preloaded(before, {name: value for name, value in os.environ.items() if before.get(name) != value})


def serve(listener: socket.socket, preloaded: Preloaded) -> Request | None:
    """Answer requests on `listener`. Returns a child's request in that child (its environment
    with what the imports would have added to it); None in the server once its lifeline closed."""
    home = os.getcwd()
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "accept")
    selector.register(sys.stdin.fileno(), selectors.EVENT_READ, "lifeline")
    children: dict[int, tuple[int, socket.socket]] = {}  # pidfd -> (pid, the client's connection)
    while True:
        for key, _ in selector.select():
            if key.data == "lifeline":
                if not os.read(key.fd, 4096):
                    return None
            elif key.data == "accept":
                conn, _ = listener.accept()
                request = _receive(conn, preloaded, home)
                if request is None:
                    continue
                try:
                    pid = os.fork()
                except OSError as e:  # out of processes or memory: the client tries a fresh interpreter
                    _close(request)
                    _tell(conn, {"refused": f"fork: {e}"})
                    conn.close()
                    continue
                if pid == 0:
                    selector.close()
                    listener.close()
                    for pidfd, (_, other) in children.items():
                        os.close(pidfd)
                        other.close()
                    conn.close()
                    return request
                _close(request)
                pidfd = os.pidfd_open(pid)
                children[pidfd] = (pid, conn)
                selector.register(pidfd, selectors.EVENT_READ, "child")
                _tell(conn, {"pid": pid}, [pidfd])
            else:
                pid, conn = children.pop(key.fd)
                selector.unregister(key.fd)
                os.close(key.fd)
                _, status = os.waitpid(pid, 0)
                _tell(conn, {"returncode": os.waitstatus_to_exitcode(status)})
                conn.close()


def _receive(conn: socket.socket, preloaded: Preloaded, home: str) -> Request | None:
    """The connection's request, or None when it was refused (the client was told why) or broken."""
    conn.settimeout(REQUEST_TIMEOUT_S)
    try:
        message, fds = protocol.receive(conn, max_fds=4)
    except (OSError, ValueError):
        conn.close()
        return None
    conn.settimeout(None)
    if message is None or len(fds) not in (3, 4):
        for fd in fds:
            os.close(fd)
        conn.close()
        return None
    request = Request(message["main"], message["args"], message["env"], message["cwd"], message["new_session"],
                      fds[:3], fds[3] if len(fds) == 4 else None)
    reason = _refusal(request, preloaded, home)
    if reason is not None:
        _close(request)
        _tell(conn, {"refused": reason})
        conn.close()
        return None
    request.env.update(preloaded.effects)
    return request


def _refusal(request: Request, preloaded: Preloaded, home: str) -> str | None:
    return _program_refusal(request.main) or _environment_refusal(request, preloaded) or _path_refusal(request, home)


def _program_refusal(main: list[str]) -> str | None:
    if main[:1] == ["-m"]:
        return None if main[1:] and main[1] in protocol.MODULES else f"runs no module {' '.join(main[1:])}"
    return None if len(main) == 1 and os.path.isabs(main[0]) and os.path.isfile(main[0]) else f"no script {main}"


def _environment_refusal(request: Request, preloaded: Preloaded) -> str | None:
    signature = inherited_env.signature(preloaded.env)
    accepted: dict[str, set[str | None]] = {name: {value} for name, value in signature.items()}
    # What the imports set, as it was before them or as they set it: the processes a served child
    # starts (a supervisor's, torchrun's workers) inherit the latter.
    for name, value in preloaded.effects.items():
        accepted.setdefault(name, {preloaded.env.get(name)}).add(value)
    wanted = inherited_env.signature(request.env) | {name: request.env.get(name) for name in preloaded.effects}
    differ = {name for name in wanted.keys() | accepted.keys() if wanted.get(name) not in accepted.get(name, {None})}
    return f"environment differs in {', '.join(sorted(differ))}" if differ else None


def _path_refusal(request: Request, home: str) -> str | None:
    """The folder a fresh interpreter would put first on sys.path (first_on_path, below) holding a
    module of the name of one the server imported from elsewhere."""
    folder = first_on_path(request)
    if folder is None or os.path.realpath(folder) == os.path.realpath(home):
        return None
    try:
        entries = {entry.removesuffix(".py") for entry in os.listdir(folder)}
    except OSError as e:
        return f"{folder}: {e}"
    shadowed = sorted(entries & {name.partition(".")[0] for name in sys.modules})
    return f"{folder} holds {', '.join(shadowed)}, which the server imported from elsewhere" if shadowed else None


def first_on_path(request: Request) -> str | None:
    """What a fresh interpreter puts first on sys.path: the working folder for `-m`, the script's
    folder for a script; nothing under -P (sys.flags.safe_path: the server's, so the child's)."""
    if sys.flags.safe_path:
        return None
    return request.cwd if request.main[0] == "-m" else os.path.dirname(os.path.realpath(request.main[0]))


def _close(request: Request) -> None:
    """Close the server's copies of a request's fds (a forked child has its own)."""
    for fd in {f for f in (*request.fds, request.lifeline) if f is not None}:
        os.close(fd)


def _tell(conn: socket.socket, message: dict[str, Any], fds: Sequence[int] = ()) -> None:
    """Send to a client that may have gone (its child runs on regardless)."""
    try:
        protocol.send(conn, message, fds)
    except OSError:
        pass
