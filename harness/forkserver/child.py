"""A forked child made into the process a fresh `python -m harness.cli ARGS` would be.

`become(request)` runs first in the child, before any of the program: a session of its own when
asked (`start_new_session`), the client's stdin/stdout/stderr on fds 0-2, the working folder
(first on sys.path, as `-m` puts it), the environment (os.environ and the C environment: the
program's subprocesses get it), argv, and new sys.stdin/stdout/stderr made as the interpreter
makes them at start-up (buffering follows the new fds: a terminal is line-buffered, a pipe not).
What it cannot redo is what the server's libraries read at their start-up; the server refuses
a request whose environment differs there (harness/forkserver/inherited_env.py).

Randomness: Python's `random` reseeds itself in a forked child; numpy's global generator is
reseeded here from the OS as a fresh import would seed it; torch's default generator was never
used in the server, so it holds torch's fixed default seed as in a fresh interpreter (the harness
seeds every generator itself before training: harness/repro/rng.py). The str hash seed is the server's
(one per server), as any single interpreter's is.

Exit: `run()` runs harness.cli as `-m` does; its SystemExit (or an uncaught exception) ends the
child through the interpreter's own shutdown (threads joined, atexit handlers, stdio flushed),
as a fresh one ends.
"""

from __future__ import annotations

import io
import os
import runpy
import sys

from harness.forkserver.server import Request

MODULE = "harness.cli"


def become(request: Request) -> None:
    if request.new_session:
        os.setsid()
    for target, fd in enumerate(request.fds):
        os.dup2(fd, target)
    for fd in set(request.fds):
        os.close(fd)
    os.chdir(request.cwd)
    if not sys.flags.safe_path:
        sys.path[0] = os.getcwd()
    os.environ.clear()
    os.environ.update(request.env)
    sys.argv = [MODULE, *request.args]  # runpy puts the module's file first, as `-m` does
    sys.orig_argv = [sys.executable, "-m", MODULE, *request.args]
    _reopen_stdio()
    if "numpy.random" in sys.modules:
        sys.modules["numpy.random"].seed()


def run() -> None:
    runpy.run_module(MODULE, run_name="__main__", alter_sys=True)


def _reopen_stdio() -> None:
    """sys.stdin/stdout/stderr anew on fds 0-2, as CPython's start-up (create_stdio) makes them,
    with the server's encodings (its locale and PYTHONIOENCODING are the child's: environment.py)."""
    unbuffered = sys.stdout.write_through  # how the server's start-up made it: -u or PYTHONUNBUFFERED
    for fd, name in enumerate(("stdin", "stdout", "stderr")):
        old = getattr(sys, name)
        writing = fd > 0
        raw_only = writing and unbuffered  # stdin is buffered always (TextIOWrapper needs read1)
        buffer = io.open(fd, "wb" if writing else "rb", 0 if raw_only else -1, closefd=False)
        raw = buffer if raw_only else buffer.raw
        raw.name = f"<{name}>"
        stream = io.TextIOWrapper(buffer, encoding=old.encoding, errors=old.errors, newline="\n",
                                  line_buffering=not unbuffered and (raw.isatty() or fd == 2),
                                  write_through=unbuffered)
        stream.mode = "w" if writing else "r"
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)
