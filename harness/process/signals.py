"""Preemption: a stop signal becomes "save at the next step boundary, within a deadline, then exit".

Contract with the trainer (the whole integration is these lines):

    with PreemptionWatch() as watch:
        for step in ...:
            train_step()
            if watch.requested:
                with SaveDeadline(cfg.deadline_s, since=watch.requested_at):
                    store.save(step, parts)          # and wait until it is committed
                return PREEMPTED

`PreemptionWatch` installs handlers for SIGTERM, SIGINT and SIGUSR1 (configurable) that only
record the signal: the optimizer step in progress is never interrupted, so the state that is
saved is a consistent step boundary. A second (third, ...) signal is recorded and announced,
nothing more: it cannot throw an exception into the middle of a save.

A handler must not write through Python's buffered `sys.stderr`: if the signal lands while the
main thread is inside a write to the same stream, the nested write raises "reentrant call"
into whatever the main thread was doing, possibly a save. So the announcement goes out as one
`os.write` on file descriptor 2, and structured logging of the request is left to the code that
acts on it.

`SaveDeadline` is a watchdog thread. If the save has not called `done()` (or left the `with`
block) when the deadline passes, it logs and calls `os._exit(SAVE_DEADLINE_MISSED)` at once,
from its own thread, whatever the main thread is doing. That is safe *only because* the
checkpoint commit is atomic (tmp folder + rename locally, manifest written last on object
stores): an interrupted save leaves at worst an uncommitted temporary that discovery ignores
and retention cleans, and the previous checkpoint stays the newest good one. Exiting before the
launcher's hard kill (k8s `terminationGracePeriodSeconds`, SLURM `--signal=...@T`) keeps the
exit code meaningful. The deadline counts from `since` (pass `watch.requested_at`: the grace
period started at the signal, not at the save). The watchdog can only fire while the GIL is
released or bytecode runs; torch kernels and file I/O release it.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterable
from types import FrameType
from typing import Any

from harness.errors import UserError
from harness.exit_codes import SAVE_DEADLINE_MISSED
from harness.log import get_logger

log = get_logger(__name__)

DEFAULT_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1")


def parse_signals(names: Iterable[str]) -> list[signal.Signals]:
    """Signal names ("SIGTERM" or "TERM") -> signals; an unknown name is a `UserError`."""
    out = []
    for name in names:
        full = name.upper() if name.upper().startswith("SIG") else "SIG" + name.upper()
        try:
            out.append(signal.Signals[full])
        except KeyError:
            raise UserError(
                f"unknown signal {name!r}: use names such as SIGTERM, SIGINT, SIGUSR1"
            ) from None
    return out


class PreemptionWatch:
    """Record stop signals while installed (a context manager; restores the previous handlers).

    `requested` turns true at the first signal; `signal_name` and `requested_at` (a `clock()`
    value) describe that first one, `count` counts all of them. `on_signal(signum)`, if given,
    runs inside the handler after the recording (the supervisor forwards signals with it); it
    must be signal-safe: no buffered I/O, no locks.

    Install from the main thread only (Python delivers signals there); otherwise `UserError`.
    """

    def __init__(
        self,
        signals: Iterable[str] = DEFAULT_SIGNALS,
        *,
        on_signal: Callable[[int], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._signals = parse_signals(signals)
        self._on_signal = on_signal
        self._clock = clock
        self._previous: dict[signal.Signals, Any] = {}
        self.signal_name: str | None = None
        self.requested_at: float | None = None
        self.count = 0

    @property
    def requested(self) -> bool:
        return self.count > 0

    def __enter__(self) -> PreemptionWatch:
        if threading.current_thread() is not threading.main_thread():
            raise UserError(
                "PreemptionWatch must be installed from the main thread (Python delivers "
                "signals only there): run the training loop in the main thread"
            )
        for sig in self._signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.count += 1
        name = signal.Signals(signum).name
        if self.count == 1:
            self.signal_name = name
            self.requested_at = self._clock()
            note = f"harness[{os.getpid()}]: received {name}: stop requested\n"
        else:
            note = f"harness[{os.getpid()}]: received {name} again (#{self.count}): already stopping\n"
        os.write(2, note.encode())
        if self._on_signal is not None:
            self._on_signal(signum)


class SaveDeadline:
    """Watchdog for the preemption save: exit the process if it is not done within `seconds`.

    `seconds` counts from `since` (a `clock()` value; default: now). Use as a context manager,
    or call `start()` and `done()`. On expiry: one error log line, then `exit(exit_code)`
    (`os._exit` by default: no cleanup, no waiting for other threads, which might be the very
    save that is stuck). `clock` and `exit` are injectable for tests.
    """

    def __init__(
        self,
        seconds: float,
        *,
        since: float | None = None,
        exit_code: int = SAVE_DEADLINE_MISSED,
        clock: Callable[[], float] = time.monotonic,
        exit: Callable[[int], object] = os._exit,
    ) -> None:
        if seconds <= 0:
            raise UserError(
                f"preemption save deadline must be > 0 seconds, got {seconds}: set it a few "
                "seconds below the launcher's grace period"
            )
        self.seconds = seconds
        self._clock = clock
        self._since = since
        self._exit_code = exit_code
        self._exit = exit
        self._finished = threading.Event()
        self._thread: threading.Thread | None = None

    def remaining(self) -> float:
        """Seconds left before the watchdog fires (negative once it has passed)."""
        since = self._since if self._since is not None else self._clock()
        return since + self.seconds - self._clock()

    def start(self) -> SaveDeadline:
        if self._since is None:
            self._since = self._clock()
        self._thread = threading.Thread(target=self._watch, name="save-deadline", daemon=True)
        self._thread.start()
        return self

    def done(self) -> None:
        """The save is committed: disarm the watchdog."""
        self._finished.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def __enter__(self) -> SaveDeadline:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.done()

    def _watch(self) -> None:
        if self._finished.wait(max(0.0, self.remaining())):
            return
        try:
            log.error(
                "preemption save missed its deadline; exiting without it, the previous checkpoint "
                "stays the newest good one. Raise the deadline and the launcher's grace period "
                "if this repeats",
                deadline_s=self.seconds,
                exit_code=self._exit_code,
            )
        finally:  # the exit is the promise; a broken log stream must not keep the process alive
            self._exit(self._exit_code)
