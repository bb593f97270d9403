"""The client side of a fork server: `ForkServer` starts and ends a server process, `NamedServer`
is one another process started (known by its socket), `ForkedPopen` is a subprocess.Popen whose
child a server forks.

`ForkedPopen` is a Popen (pipes, text mode, communicate, wait and poll with timeouts, `with`,
send_signal/terminate/kill, pid, returncode) for `[sys.executable, "-m", MODULE, ...]` (a module of
protocol.MODULES: the harness's CLI, torchrun's launcher) or `[sys.executable, "SCRIPT.py", ...]`
with the options `Server.popen` takes. Its child is a child of the server, not of the caller: its
exit code comes from the server, which reaps it, and signals go through a pidfd, so they cannot
reach another process that took its pid. A command line of another form, or a request the server
refuses (an environment it cannot honour: harness/forkserver/inherited_env.py), starts a fresh
interpreter through Popen's own code: the same object, the same behaviour. So does a server that
found it cannot fork safely (protocol.UNSERVABLE), and a named server that does not answer; a server
started here and gone otherwise raises `ForkServerError` (a bug, not a reason to fall back quietly).

What a child inherits from its server, not from the caller at the time of the call: umask,
resource limits, CPU affinity, user and groups (the caller's when the server started), and its
parent (the server: the children of `harness supervise` still die with the supervisor, whose
PR_SET_PDEATHSIG names it). A caller that changes those between calls needs fresh interpreters.
"""

from __future__ import annotations

import abc
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harness.forkserver import protocol

if TYPE_CHECKING:
    from subprocess import _CMD, _FILE  # what Popen runs, and a stdin/stdout/stderr it takes


class ForkServerError(RuntimeError):
    pass


def served(args: object) -> tuple[list[str], list[str]] | None:
    """(what the interpreter is told to run, the arguments after it) of a command line a server
    runs with this interpreter: `python -m MODULE ...` (a module of protocol.MODULES) or `python
    SCRIPT.py ...` (the script's path as given; the request makes it absolute, so a forked script's
    sys.argv[0] is its absolute path where the interpreter would keep a relative one); else None."""
    if not isinstance(args, (list, tuple)) or len(args) < 2 or args[0] != sys.executable:
        return None
    words = [str(a) for a in args[1:]]
    if words[0] == "-m":
        return (words[:2], words[2:]) if len(words) > 1 and words[1] in protocol.MODULES else None
    return ([words[0]], words[1:]) if words[0].endswith(".py") else None


class Server(abc.ABC):
    """A fork server as its clients know it: the socket it listens on, what a client does when it
    gets no answer there (`unanswered`) and what it can say of a server gone (`failure`)."""

    socket_path: str

    def popen(self, args: _CMD, *, env: Mapping[str, str] | None = None, cwd: str | Path | None = None,
              stdin: _FILE = None, stdout: _FILE = None, stderr: _FILE = None, text: bool | None = None,
              start_new_session: bool = False) -> subprocess.Popen[Any]:  # [str] with `text`, else [bytes]
        return ForkedPopen(self, args, env=env, cwd=cwd, stdin=stdin, stdout=stdout, stderr=stderr, text=text,
                           start_new_session=start_new_session)

    @abc.abstractmethod
    def unanswered(self, error: OSError | None) -> None:
        """The server did not answer a request: return to have the client start a fresh
        interpreter, or raise ForkServerError."""

    @abc.abstractmethod
    def failure(self) -> str:
        """Why the server is gone, as far as a client can tell."""


class ForkServer(Server):
    """A server process started with `env` in `cwd` (its socket and log in `folder`)."""

    def __init__(self, env: Mapping[str, str], cwd: str | Path, folder: str | Path, name: str = "server"):
        self.socket_path = str(Path(folder) / f"{name}.sock")
        self.log_path = Path(folder) / f"{name}.log"
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            listener.bind(self.socket_path)
            listener.listen(128)
            with open(self.log_path, "wb") as log:
                self.process = subprocess.Popen(
                    [sys.executable, "-m", "harness.forkserver", str(listener.fileno())],
                    stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=log, env=dict(env), cwd=cwd,
                    pass_fds=[listener.fileno()])
        finally:
            listener.close()  # the server holds it now: requests queue there while it imports

    def unanswered(self, error: OSError | None) -> None:
        """A fresh interpreter if the server found it cannot serve, else raise: it is gone by a bug."""
        try:
            self.process.wait(protocol.REPLY_TIMEOUT_S)  # it is exiting, or has
        except subprocess.TimeoutExpired:
            pass
        if not self.unservable():
            raise ForkServerError(f"{error or 'no reply'}; {self.failure()}") from error

    def unservable(self) -> bool:
        """Whether the server found it cannot fork safely in its environment (and exited)."""
        return self.process.poll() == protocol.UNSERVABLE

    def failure(self) -> str:
        """Why the server is gone (its exit code and the end of its log)."""
        code = self.process.poll()
        return f"fork server exited {code}: {self.log_path.read_text(errors='replace')[-3000:]}"

    def close(self, timeout: float = 30) -> None:
        """End the server (its children run on, as Popen children outlive their parent)."""
        if self.process.stdin is not None:
            self.process.stdin.close()  # the lifeline
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class NamedServer(Server):
    """A server another process started, known by its socket (the one relay.SERVER_ENV names, as
    for the test session's). One that is gone (or never there) leaves a fresh interpreter, as it
    leaves a relay running the command itself; one that took the request and did not answer in
    time is an error (it may still fork the child: a fresh one beside it would run the command twice)."""

    def __init__(self, socket_path: str):
        self.socket_path = socket_path

    def unanswered(self, error: OSError | None) -> None:
        if isinstance(error, TimeoutError):
            raise ForkServerError(f"the fork server at {self.socket_path} did not answer within "
                                  f"{protocol.REPLY_TIMEOUT_S} s") from error

    def failure(self) -> str:
        return f"the fork server at {self.socket_path} is gone"


# Popen's private methods overridden and called here (_execute_child, _internal_poll, _wait,
# _close_pipe_fds) are not in typeshed: their calls carry `type: ignore` (undefined in superclass).
class ForkedPopen(subprocess.Popen[Any]):
    def __init__(self, server: Server, args: _CMD, *, start_new_session: bool = False, **kwargs: Any):
        self._server = server
        self._new_session = start_new_session
        self.forked = False  # whether the server forked the child (else Popen started a fresh interpreter)
        self._conn: socket.socket | None = None  # open until the exit code came
        self._pidfd: int | None = None  # likewise
        super().__init__(args, start_new_session=start_new_session, **kwargs)

    def _execute_child(self, args: _CMD, executable: str | bytes | os.PathLike[Any] | None,
                       preexec_fn: Callable[[], object] | None, close_fds: bool, pass_fds: Sequence[int],
                       cwd: str | os.PathLike[str] | None, env: Mapping[str, str] | None, startupinfo: Any,
                       creationflags: int, shell: bool, p2cread: int, p2cwrite: int, c2pread: int, c2pwrite: int,
                       errread: int, errwrite: int, *rest: Any) -> None:
        command = served(args) if executable is None and not shell else None
        reply = None if command is None else self._request(*command, env, cwd, [
            p2cread if p2cread != -1 else 0, c2pwrite if c2pwrite != -1 else 1, errwrite if errwrite != -1 else 2])
        if reply is None:
            super()._execute_child(  # type: ignore[misc]
                args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo, creationflags, shell,
                p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite, *rest)
            return
        self.pid, self._pidfd = reply
        self.forked = self._child_created = True
        self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)  # type: ignore[attr-defined]

    def _request(self, main: list[str], args: list[str], env: Mapping[str, str] | None,
                 cwd: str | os.PathLike[str] | None, fds: list[int]) -> tuple[int, int] | None:
        """(pid, pidfd) of the forked child, or None when the server refused the request."""
        cwd = os.path.abspath(os.getcwd() if cwd is None else os.fspath(cwd))
        if main[0] != "-m":
            main = [os.path.join(cwd, main[0])]  # a script's path relative to the child's working folder
        request = {"main": main, "args": args, "env": dict(os.environ if env is None else env), "cwd": cwd,
                   "new_session": self._new_session}
        try:
            reply = protocol.ask(self._server.socket_path, request, fds)
        except protocol.TooLarge:
            return None
        except OSError as e:
            self._gone(e)
            return None
        if isinstance(reply, str):
            return None
        self._conn, pid, pidfd = reply
        return pid, pidfd

    def _gone(self, error: OSError | None) -> None:
        """The server did not answer: None (a fresh interpreter), or ForkServerError (`unanswered`)."""
        self._server.unanswered(error)

    def _internal_poll(self, _deadstate: int | None = None, **kwargs: Any) -> int | None:
        if not self.forked:
            return super()._internal_poll(_deadstate=_deadstate, **kwargs)  # type: ignore[misc, no-any-return]
        if self.returncode is None:
            assert self._conn is not None  # a forked child's, open until the exit code came
            self._conn.setblocking(False)
            try:
                self._receive_exit(_deadstate)
            except BlockingIOError:
                pass
        return self.returncode

    def _wait(self, timeout: float | None) -> int:
        if not self.forked:
            return super()._wait(timeout)  # type: ignore[misc, no-any-return]
        if self.returncode is None:
            assert self._conn is not None  # a forked child's, open until the exit code came
            self._conn.settimeout(timeout)
            try:
                self._receive_exit(None)
            except TimeoutError:
                assert timeout is not None  # a socket without a timeout blocks instead
                raise subprocess.TimeoutExpired(self.args, timeout) from None
        return self.returncode

    def _receive_exit(self, deadstate: int | None) -> None:
        """The exit code from the server; `deadstate` stands for it if the server is gone (Popen's
        finalizer), else that raises."""
        conn, pidfd = self._conn, self._pidfd
        assert conn is not None and pidfd is not None  # a forked child's, open until the exit code came
        message, _ = protocol.receive(conn)
        if message is None and deadstate is None:
            raise ForkServerError(f"pid {self.pid}: no exit code; {self._server.failure()}")
        self.returncode = deadstate if message is None else message["returncode"]
        conn.close()
        os.close(pidfd)
        self._conn = self._pidfd = None

    def send_signal(self, sig: int) -> None:
        if not self.forked:
            super().send_signal(sig)
            return
        self.poll()
        if self.returncode is None:
            assert self._pidfd is not None  # a forked child's, open until the exit code came
            try:
                signal.pidfd_send_signal(self._pidfd, sig)
            except ProcessLookupError:
                pass  # it ended since the poll (Popen ignores this too)
