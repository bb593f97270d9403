"""A process that must not outlive the process that started it: SIGKILL when its parent dies, or
when the relay that stands for it dies.

Linux's PR_SET_PDEATHSIG asks the kernel to send a signal when the parent exits (strictly, the
parent's thread that started the process: the supervisor and torchrun's agent start theirs from
the main thread); SIGKILL is what a process killed with its launcher would get. Two processes
ask for it:
* the child of the supervisor (harness/process/supervisor.py, `preexec`): it runs in a session of its own
  (a terminal's Ctrl-C reaches it once, forwarded), so a SIGKILLed supervisor would otherwise
  leave a second writer behind for its successor;
* a rank under torchrun (`die_with_launcher`, first thing in the CLI): torchrun starts every
  worker in a session of its own, so a SIGKILL of torchrun's process group does not reach them,
  and nothing in torch stops a worker whose agent died: orphans would train on alone to the end
  of the run and hold the run dir's lease against a relaunch (which every rank would refuse
  with exit 2). Killed with their agent, they are gone by the time a relaunch asks for the
  lease; the lease takes over from a holder on this host that is gone, or still exiting after a
  few seconds' grace (harness/checkpoint/lease.py).

The race: a parent that dies after starting the process but before the request took effect sends
nothing. The process compares its parent after the request with the one it had before and, if
it changed, kills itself as the kernel would have. A launcher that died before the process read
its parent at all (about 0.1 s from fork to the CLI's first line: the interpreter's start and
the CLI's imports) is not seen: the process was already the child of init or a subreaper, which
cannot be told from a launcher by its pid. Elsewhere than Linux nothing is asked.

A fork server's child started for a relay (harness/forkserver/relay.py: the process the launcher
started, which had the server fork the real one) is the server's child, so no PDEATHSIG can name
the launcher's process. It dies with the relay instead (`die_with_relay`), and the relay dies with
the launcher as above: the relay alone holds the write end of a pipe whose read end the child has
marked O_ASYNC with F_SETSIG = SIGKILL, and the kernel signals a pipe's asynchronous readers when
its last writer closes, which a process's end does however it ends, SIGKILL included. The kernel
sends it: the child runs nothing for it, so a main thread that holds the GIL or hangs in C cannot
delay it. Such a child skips `die_with_launcher` (its parent is the server, not the launcher).
This module imports nothing heavy: the CLI calls it first.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import select
import signal
import sys
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1
# Set by torchrun (torch.distributed.elastic) in every worker's environment.
_TORCHRUN_WORKER_ENV = "TORCHELASTIC_RUN_ID"
_relayed = False  # this process dies with a relay (die_with_relay), not with its parent


def _libc() -> ctypes.CDLL | None:
    return ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def _die_with(libc: ctypes.CDLL, parent: int) -> None:
    """SIGKILL this process when `parent` (its parent now) dies, or at once if it already has."""
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before prctl took effect
        os.kill(os.getpid(), signal.SIGKILL)


def preexec() -> Callable[[], None] | None:
    """A `preexec_fn` for subprocess.Popen that makes the child die with the calling process."""
    libc = _libc()  # loaded before fork: dlopen is not fork-safe
    if libc is None:
        return None
    parent = os.getpid()
    return lambda: _die_with(libc, parent)


def die_with_launcher() -> None:
    """Under torchrun: die with the agent that started this worker (see the module docstring);
    a relayed process dies with its relay instead."""
    if _TORCHRUN_WORKER_ENV not in os.environ or _relayed:
        return
    libc = _libc()
    if libc is not None:
        _die_with(libc, os.getppid())


def die_with_relay(lifeline: int) -> None:
    """SIGKILL this process the moment the write end of the pipe whose read end is `lifeline`
    closes (the relay that alone holds it ended), or at once if it already has (see the module
    docstring)."""
    global _relayed
    _relayed = True
    os.set_inheritable(lifeline, False)  # received without O_CLOEXEC; a program this process execs needs none
    fcntl.fcntl(lifeline, fcntl.F_SETOWN, os.getpid())
    fcntl.fcntl(lifeline, fcntl.F_SETSIG, signal.SIGKILL)
    fcntl.fcntl(lifeline, fcntl.F_SETFL, fcntl.fcntl(lifeline, fcntl.F_GETFL) | os.O_ASYNC)
    # The relay never writes: readable means no writer is left, perhaps since before O_ASYNC took
    # effect, when the kernel had nobody to signal.
    if select.select([lifeline], [], [], 0)[0]:
        os.kill(os.getpid(), signal.SIGKILL)
