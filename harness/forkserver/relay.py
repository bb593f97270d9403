"""The relay: the `harness` process a launcher starts (a torchrun worker, the supervisor's child)
standing in for a fork server's child that does the work, so that the work starts without a fresh
interpreter importing torch (2-3 CPU-seconds a process, docs/bench-runs.md).

Where `HARNESS_FORK_SERVER` in the environment names a fork server's socket (the test session
sets it for what it starts: tests/procs.py), `relayed(args)`, which the CLI calls first for its
own command line, asks that server for `python -m harness.cli ARGS` with this process's
environment, working folder and stdio, in a session of its own (torchrun and the supervisor start
theirs so too), and then stays, as the process its launcher knows:
* the signals that stop or nudge a run (FORWARDED) go on to the child, through a pidfd (never to
  another process that took its pid); job control (SIGSTOP, SIGTSTP, SIGCONT) does not;
* it ends as the child ended: with its exit code, or killed by the same signal;
* the child dies the moment the relay does, however the relay ends, SIGKILL included: the relay
  alone holds the write end of the child's lifeline (harness/process/parent_death.py,
  `die_with_relay`). So whatever kills the relay kills the child, as it would have killed a fresh
  process in the relay's place: a launcher's SIGKILL, a lost node's, PR_SET_PDEATHSIG on the relay's
  own parent (torchrun's agent: `die_with_launcher`; the supervisor: its preexec).

`relayed` returns None, and the process runs the command itself as it would without a server,
where the variable is unset, in a fork server and its children (`disable`: they are the real
processes), where the server refuses (an environment it cannot honour: inherited_env.py; a working
folder that would shadow an import) and where it cannot be reached (no server at that path any
more). This module imports nothing heavy: a relay costs an interpreter's start and the CLI's
imports, no torch.
"""

from __future__ import annotations

import contextlib
import os
import resource
import select
import signal
import sys

from harness.forkserver import protocol

SERVER_ENV = "HARNESS_FORK_SERVER"
# What launchers and people send to stop a run or ask for something (harness/process/signals.py
# handles SIGTERM, SIGINT, SIGUSR1; torchrun's agent and SLURM send SIGTERM, SIGINT, SIGHUP, SIGQUIT).
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)

_enabled = True


def disable() -> None:
    """This process never relays, nor any child it forks afterwards (a fork server: its children
    are the real processes)."""
    global _enabled
    _enabled = False


def relayed(args: list[str]) -> int | None:
    """Have the fork server named in the environment run `harness ARGS` and stand in for it (see
    the module docstring): the exit code this process should end with, or None where this process
    must run the command itself."""
    path = os.environ.get(SERVER_ENV)
    if not _enabled or not path:
        return None
    lifeline, held = os.pipe()  # `held` stays open as long as this process lives
    # Blocked while asking: a signal that comes meanwhile goes to the child, or, if there is none,
    # is handled as it would have been without a relay.
    signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
    try:
        reply = protocol.ask(path, {"main": ["-m", "harness.cli"], "args": args, "env": dict(os.environ),
                                    "cwd": os.getcwd(), "new_session": True}, [0, 1, 2, lifeline])
    except (OSError, ValueError, protocol.TooLarge):  # ValueError: a reply that is not the protocol's JSON
        reply = None
    finally:
        os.close(lifeline)
    if not isinstance(reply, tuple):
        os.close(held)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
        return None
    conn, pid, pidfd = reply
    for signum in FORWARDED:
        signal.signal(signum, lambda signum, _frame: _forward(pidfd, signum))
    signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
    message, _ = protocol.receive(conn)
    if message is None:  # the server ended first: it would have reaped the child and sent its code
        select.select([pidfd], [], [])
        print(f"harness: the fork server ended before its child {pid}, whose exit code is lost", file=sys.stderr)
        return 1
    return _end_as(message["returncode"])


def _forward(pidfd: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # it has ended: its exit code is on its way
        signal.pidfd_send_signal(pidfd, signum)


def _end_as(code: int) -> int:
    """The exit code `code` (a Popen return code) for this process to end with; a negative one (the
    child was killed by signal -code) kills this process with the same signal."""
    if code >= 0:
        return code
    with contextlib.suppress(OSError):  # SIGKILL's disposition cannot be set, nor needs to be
        signal.signal(-code, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [-code])
    # The child dumped its core already if it was to; the relay's would be a second, of nothing.
    resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))
    os.kill(os.getpid(), -code)
    return 128 - code  # not reached: a signal that ended the child ends this process too
