"""A forked child made into the process a fresh `python -m MODULE ARGS` (the harness's CLI, or
torchrun's launcher: protocol.MODULES) or `python SCRIPT ARGS` would be.

`become(request)` runs first in the child, before any of the program: death with its relay if a
relay asked for it (first: harness/process/parent_death.py `die_with_relay`), a session of its own
when asked (`start_new_session`), the client's stdin/stdout/stderr on fds 0-2, the working folder
(first on sys.path, as `-m` puts it; a script's own folder instead), the environment (os.environ and
the C environment: the program's subprocesses get it), argv, and new sys.stdin/stdout/stderr made as
the interpreter makes them at start-up (buffering follows the new fds: a terminal is line-buffered,
a pipe not). What it cannot redo is what the server's libraries read at their start-up; the server
refuses a request whose environment differs there (harness/forkserver/inherited_env.py).

Randomness: Python's `random` reseeds itself in a forked child; numpy's global generator is
reseeded here from the OS as a fresh import would seed it; torch's default generator was never
used in the server, so it holds torch's fixed default seed as in a fresh interpreter (the harness
seeds every generator itself before training: harness/repro/rng.py). The str hash seed is the server's
(one per server), as any single interpreter's is.

Exit: `run(main)` runs the module as `-m` does (or the script as the interpreter does) and ends the
child as a fresh interpreter ends up to its finalization (non-daemon threads joined, atexit handlers
run, stdio flushed, the exit code a `SystemExit` gives, printed as the interpreter prints it), then
leaves with `os._exit`, as a process that joined a process group does
(harness/process/process_end.py). Finalization would free every object the server imported, and
freeing writes to each one: the child copied some 170 MB of the server's pages for it, 0.26 of the
0.33 CPU-seconds of a forked `harness --help` (0.25 of 0.42 of a 12-step tiny training). What is
skipped is only that freeing, which the operating system does anyway, and the `__del__` of objects
still alive at exit, which Python does not promise either. An exception other than `SystemExit` (a
traceback: a bug, or torchrun reporting a failed worker group) ends the child through the
interpreter's own shutdown, as it ends a fresh interpreter.
"""

from __future__ import annotations

import io
import os
import runpy
import sys
from typing import NoReturn, cast

from harness.forkserver.server import Request, first_on_path
from harness.process import parent_death, process_end


def become(request: Request) -> None:
    if request.lifeline is not None:
        parent_death.die_with_relay(request.lifeline)
    if request.new_session:
        os.setsid()
    for target, fd in enumerate(request.fds):
        os.dup2(fd, target)
    for fd in set(request.fds):
        os.close(fd)
    os.chdir(request.cwd)
    first = first_on_path(request)
    if first is not None:
        sys.path[0] = first
    os.environ.clear()
    os.environ.update(request.env)
    sys.argv = [request.main[-1], *request.args]  # for -m runpy puts the module's file first, as `-m` does
    sys.orig_argv = [sys.executable, *request.main, *request.args]
    _reopen_stdio()
    if "numpy.random" in sys.modules:
        sys.modules["numpy.random"].seed()


def run(main: list[str]) -> NoReturn:
    try:
        if main[0] == "-m":
            runpy.run_module(main[1], run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(main[0], run_name="__main__")
    except SystemExit as e:
        process_end.leave(process_end.unhandled(e))
    process_end.leave(0)


def _reopen_stdio() -> None:
    """sys.stdin/stdout/stderr anew on fds 0-2, as CPython's start-up (create_stdio) makes them,
    with the server's encodings (its locale and PYTHONIOENCODING are the child's: environment.py)."""
    # How the server's start-up made it (a TextIOWrapper, as create_stdio makes it): -u or PYTHONUNBUFFERED.
    unbuffered = cast(io.TextIOWrapper, sys.stdout).write_through
    for fd, name in enumerate(("stdin", "stdout", "stderr")):
        old = getattr(sys, name)
        writing = fd > 0
        raw_only = writing and unbuffered  # stdin is buffered always (TextIOWrapper needs read1)
        buffer = open(fd, "wb" if writing else "rb", 0 if raw_only else -1, closefd=False)
        # open() returns a FileIO unbuffered, else a BufferedReader/BufferedWriter over one.
        buffered = cast("io.BufferedReader[io.FileIO] | io.BufferedWriter[io.FileIO]", buffer)
        raw = cast(io.FileIO, buffer) if raw_only else buffered.raw
        raw.name = f"<{name}>"
        stream = io.TextIOWrapper(buffer, encoding=old.encoding, errors=old.errors, newline="\n",
                                  line_buffering=not unbuffered and (raw.isatty() or fd == 2),
                                  write_through=unbuffered)
        stream.mode = "w" if writing else "r"  # type: ignore[misc]  # read-only in typeshed; an attribute at runtime
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)
