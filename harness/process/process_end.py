"""How a process that joined a process group ends: without the interpreter's finalization.

Why: a gloo process group outlives `destroy_process_group` while anything references it, and
for a sharded run torch itself does (DTensor's sharding caches keep the FSDP mesh, the mesh keeps
its group, for the life of the process), so the group's worker threads are still running when
Python finalizes. A worker thread drops the collective it just ran a moment after that
collective completed; when the collective (or a barrier holding earlier ones) carried tensors
created in Python, dropping it takes the GIL. If the main thread has meanwhile entered
finalization, Python ends that worker thread inside a C++ destructor and the whole process
aborts: "terminate called without an active exception", SIGABRT, exit -6, after a run that had
finished and committed everything (a core dump of such a process: ~AsyncBarrierWork ->
~AsyncAllgatherWork -> TensorImpl::decref_pyobject -> take_gil -> PyThread_exit_thread, with
the main thread in Py_FinalizeEx; pytorch/pytorch#179291 is the same abort). A busy machine,
where the worker thread waits for a core, makes it likely: it was seen in 1 of 4 test suites.

Contract: `process_group(train_device)` (harness/parallel/distributed.py) calls `group_joined()` when it joins one.
`end(code)` is how a command's process finishes: without a group it returns `code` (a normal
exit); after one it does what a normal exit does up to finalization (waits for non-daemon
threads, runs the atexit handlers, flushes stdout and stderr) and leaves with `os._exit(code)`.
Every file the run wrote is closed and fsynced by the code that wrote it before this point;
what is skipped is only the freeing of objects that the operating system reclaims anyway.
This module imports nothing heavy: the CLI calls it for every command.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
import traceback
from typing import NoReturn

_joined = False


def group_joined() -> None:
    """This process has joined a process group: `end` must skip finalization."""
    global _joined
    _joined = True


def joined() -> bool:
    return _joined


def unhandled(error: BaseException) -> int:
    """For an exception that would have left the program: print what the interpreter prints for
    it, return the exit code it would give (a `SystemExit`'s own code, else 1)."""
    if isinstance(error, SystemExit):
        if error.code is None or isinstance(error.code, int):
            return error.code or 0
        print(error.code, file=sys.stderr)
        return 1
    traceback.print_exception(error)
    return 1


def end(code: int) -> int:
    """Finish the process with `code` (see the module docstring); returns only without a group."""
    if not _joined:
        return code
    leave(code)


def leave(code: int) -> NoReturn:
    """End the process now with `code`: what a normal exit does up to finalization, then
    `os._exit`. Also how a fork server's child ends (harness/forkserver/child.py)."""
    # What Py_FinalizeEx does before it starts tearing down objects: wait for non-daemon threads
    # (and stop thread pools, registered with threading's own exit hooks), run atexit handlers.
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe or stream: nothing left to say
            stream.flush()
    os._exit(code)
