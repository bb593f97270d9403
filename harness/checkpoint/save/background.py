"""One job at a time in a background thread, its failure kept for the thread that owns it.

The primitive under background saves (async_saver.py: the persist) and local-first uploads
(local_first.py: the upload), so both wait, watch and report failures the same way, and run on
the cores placed for checkpoint work (writer_cores.py):

    job = BackgroundJob("ckpt-persist", "the background save", failed=wrap)
    job.start(step, fn, *args)   # fn runs in a daemon thread; at most one job at a time
    job.poll()                   # the owner, between steps: raises a finished job's failure, once
    job.finish()                 # waits for the job (bounded by `watch`), then polls
    job.close()                  # on an error exit: like finish, but logs a failure instead

Locking discipline (one rule, so the two users cannot drift apart again): `_lock` guards the
thread handle, the job's step and the failure slot. The job thread takes it only to store its
failure; the owner takes a failure only once the thread has ended, and clears it in the same
critical section, so every failure is raised exactly once, in the owner's thread.

`failed(step, error)` turns a failure into the exception the owner raises (it names the step);
`watch(step, elapsed_s)` (optional) is called while the job runs, from `poll` and every
`wait_bounded` slice: it may warn, raise to stop waiting (a deadline), and returns the seconds
until it wants to be called again.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from harness.checkpoint.save import writer_cores
from harness.log import get_logger

log = get_logger(__name__)

# The shortest slice `wait_bounded` joins for, so a watch asking for 0 s does not spin.
_MIN_SLICE_S = 0.01


class BackgroundJob:
    """At most one job in flight; see the module docstring for the contract."""

    def __init__(self, thread_name: str, what: str, *, failed: Callable[[int, BaseException], BaseException],
                 watch: Callable[[int, float], float] | None = None) -> None:
        self.thread_name, self.what, self.failed, self.watch = thread_name, what, failed, watch
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._failure: tuple[int, BaseException] | None = None
        self.step: int | None = None  # the step of the job in flight, or of the last one
        self.started = 0.0  # time.monotonic() at its start

    @property
    def busy(self) -> bool:
        """Whether a job is running."""
        with self._lock:
            return self._alive()

    def _alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, step: int, fn: Callable[..., Any], *args: Any) -> None:
        """Run `fn(*args)` in a daemon thread as the job of `step`; one job at a time (the caller
        waits for the previous one first: a `RuntimeError` otherwise)."""
        with self._lock:
            if self._alive():
                raise RuntimeError(f"{self.what} of step {self.step} is still running")
            self.step, self.started = step, time.monotonic()
            self._thread = threading.Thread(target=self._run, args=(step, fn, args),
                                            name=f"{self.thread_name}-{step}", daemon=True)
            self._thread.start()

    def _run(self, step: int, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        writer_cores.enter()  # checkpoint work keeps off the training thread's core (`checkpoint.writer_cores`)
        try:
            fn(*args)
        except BaseException as e:  # kept for the owner: a thread's exception is otherwise only printed
            with self._lock:
                self._failure = (step, e)

    def poll(self) -> None:
        """While the job runs: `watch` it. Once it ended: raise its failure (`failed(...)`), once."""
        with self._lock:
            running = self._alive()
            failure, self._failure = (None, self._failure) if running else (self._failure, None)
        if running:
            if self.watch is not None:
                assert self.step is not None  # set by `start`, before the thread that runs
                self.watch(self.step, time.monotonic() - self.started)
            return
        if failure is not None:
            step, e = failure
            raise self.failed(step, e) from e

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the job, at most `timeout` seconds (None: for ever); True when none is left."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
        return not self.busy

    def wait_bounded(self) -> None:
        """Wait for the job, calling `watch` as it asks (it may raise: a deadline); without a
        watch, wait until it ends."""
        if self.watch is None:
            self.wait()
            return
        while self.busy:
            assert self.step is not None  # set by `start`, before the thread that is busy
            delay = self.watch(self.step, time.monotonic() - self.started)
            self.wait(max(delay, _MIN_SLICE_S))

    def finish(self, timeout: float | None = None) -> None:
        """Wait for the job (`wait_bounded`, or at most `timeout` seconds: `TimeoutError` after
        that), then raise its failure if it failed."""
        if timeout is None:
            self.wait_bounded()
        elif not self.wait(timeout):
            raise TimeoutError(f"{self.what} of step {self.step} is still running after {timeout}s")
        self.poll()

    def close(self) -> None:
        """On an error exit: let a good job end (within `watch`'s bounds), log (not raise) a
        failure, so the error already propagating stays the one reported."""
        try:
            self.finish()
        except Exception as e:  # noqa: BLE001 - reported, not raised, on purpose (see above)
            log.error(f"{self.what} failed during an error exit", error=str(e))
