"""Auto-retry: run the training process as a child and restart it after a transient crash.

`Supervisor(cmd, ...).run() -> exit code` starts `cmd`, waits, and classifies the exit:

- 0 (FINISHED): done, exit 0.
- PREEMPTED / SAVE_DEADLINE_MISSED: the child stopped on request and storage is consistent;
  stop with the same code so the launcher requeues (restarting here would fight the preemption).
- USER_ERROR (2): a config or usage error does not heal by retrying; exit 2.
- STORAGE_UNAVAILABLE (69): the storage endpoint did not answer within the retry deadline. The
  child is restarted after the backoff of an outage streak (growing with each outage in a row,
  like a crash streak), but an outage is not a crash: it never counts toward the crash-loop
  limit. It does count toward `max_restarts`; when those are spent the supervisor exits 69
  itself, so the launcher above retries later.
- anything else (non-zero, killed by a signal): a crash. The child is restarted after an
  exponential backoff with jitter (tenacity's wait functions) and resumes by itself
  from the newest good checkpoint.

Crash loops: `progress()` returns the newest committed checkpoint step (or None; found without
reading the checkpoint's data, `checkpoint_progress`). A crash after
which it has not advanced since that child started counts toward `crash_loop_limit`; a crash
that did commit something resets the count (and the backoff), so a long run that crashes now
and then is never given up. At `crash_loop_limit` consecutive crashes without progress, or
after `max_restarts` restarts in all, the supervisor stops with GAVE_UP and an error that names
the step and quotes the child's last stderr lines (the child's stderr is passed through to ours
and the tail kept in memory).

Signals: SIGTERM, SIGINT, SIGUSR1 received by the supervisor are forwarded to the child (only
to the child: it owns its subprocesses, e.g. data loader workers, which must not be killed
under a save). After a stop signal nothing is restarted: the supervisor exits with the child's
code if that is a stop code, else PREEMPTED (committed checkpoints are atomic, so requeueing is
safe); a signal during the backoff ends it at once with PREEMPTED.

The child runs in its own session, so a terminal's Ctrl-C reaches it once (forwarded) instead
of twice, and on Linux it gets SIGKILL if the supervisor dies (harness/process/parent_death.py), so a
killed supervisor never leaves a second writer behind for its successor.

Every restart is logged with its cause and step and emitted as a "restart" event; giving up is
emitted as "gave_up" (schemas in `harness.records.goodput`).
"""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import IO, Any

import tenacity

from harness.checkpoint.discovery import latest_committed
from harness.errors import Unavailable, UserError
from harness.exit_codes import FINISHED, GAVE_UP, NAMES, PREEMPTED, REQUEUE, RETRY_LATER, USER_ERROR
from harness.log import get_logger, rank_prefix
from harness.process import parent_death
from harness.process.signals import DEFAULT_SIGNALS, PreemptionWatch
from harness.records.events import EventLog
from harness.records.run_files import events_url
from harness.storage.location import open_location

log = get_logger(__name__)


class Supervisor:
    """Run `cmd` until it finishes, is preempted, fails permanently or crash-loops.

    Arguments: `max_restarts` (>= 0) bounds the restarts in all; `crash_loop_limit` (>= 1) the
    consecutive crashes without a newer checkpoint; `progress()` returns the newest committed
    step or None; backoff before restart n of a crash streak is
    `min(backoff_initial * 2**(n-1), backoff_max) + uniform(0, jitter)` seconds (the jitter
    spreads restarts of many jobs that crashed together, e.g. on a storage outage); `events`
    receives "restart" and "gave_up"; `tail_lines` of the child's stderr are quoted on give-up.
    """

    def __init__(
        self,
        cmd: Sequence[str],
        *,
        max_restarts: int,
        crash_loop_limit: int,
        progress: Callable[[], int | None],
        backoff_initial: float = 1.0,
        backoff_max: float = 60.0,
        jitter: float = 1.0,
        events: EventLog | None = None,
        signals: Iterable[str] = DEFAULT_SIGNALS,
        tail_lines: int = 20,
        env: dict[str, str] | None = None,
    ) -> None:
        if max_restarts < 0 or crash_loop_limit < 1:
            raise ValueError(
                f"need max_restarts >= 0 and crash_loop_limit >= 1, got {max_restarts} and "
                f"{crash_loop_limit}"
            )
        self.cmd = list(cmd)
        self.max_restarts = max_restarts
        self.crash_loop_limit = crash_loop_limit
        self._progress = progress
        self._wait = tenacity.wait_exponential(multiplier=backoff_initial, max=backoff_max) + (
            tenacity.wait_random(0, jitter)
        )
        self._events = events
        self._signals = tuple(signals)
        self._tail: collections.deque[str] = collections.deque(maxlen=tail_lines)
        self._env = env
        self._child: subprocess.Popen[bytes] | None = None

    def run(self) -> int:
        restarts = 0
        streak = 0  # consecutive crashes that committed no newer checkpoint
        outages = 0  # consecutive exits on an unavailable storage
        with PreemptionWatch(self._signals, on_signal=self._forward) as watch:
            while True:
                before = self._probe()
                code = self._run_child(watch)
                if watch.requested:
                    return code if code in REQUEUE or code in (FINISHED, USER_ERROR) else PREEMPTED
                if code == FINISHED or code in REQUEUE:
                    return code
                if code == USER_ERROR:
                    log.error("child failed with a user error; not restarting", exit_code=code)
                    return USER_ERROR
                step = self._probe()
                advanced = step is not None and (before is None or step > before)
                outage = code in RETRY_LATER
                outages = outages + 1 if outage else 0
                streak = 0 if advanced else streak + (not outage)
                cause = "storage unavailable" if outage else describe_exit(code)
                if outage and restarts >= self.max_restarts:
                    log.error("the storage is still unavailable; exiting for the launcher to retry later",
                              exit_code=code, restarts=restarts)
                    return code
                if streak >= self.crash_loop_limit or restarts >= self.max_restarts:
                    return self._give_up(cause, step, streak, restarts)
                restarts += 1
                backoff = self.backoff(max(outages if outage else streak, 1))
                log.warning("child exited; restarting", cause=cause, step=step,
                            restart=restarts, backoff_s=round(backoff, 3))
                if self._events is not None:
                    self._events.emit("restart", cause=cause, exit_code=code, step=step,
                                      restart=restarts, backoff_s=backoff)
                if not _sleep_unless(watch, backoff):
                    return PREEMPTED

    def _probe(self) -> int | None:
        try:
            return self._progress()
        except (OSError, Unavailable) as e:
            # A storage hiccup must not end the supervision of a healthy run; an unknown step
            # only makes this crash count toward the crash-loop limit.
            log.warning("cannot read the newest checkpoint step", error=str(e))
            return None

    def backoff(self, attempt: int) -> float:
        """Seconds to wait before restart number `attempt` (from 1) of a crash streak."""
        # A wait strategy reads only attempt_number: no Retrying object stands behind this state.
        state = tenacity.RetryCallState(retry_object=None, fn=None, args=(), kwargs={})  # type: ignore[arg-type]
        state.attempt_number = attempt
        return self._wait(state)

    def _run_child(self, watch: PreemptionWatch) -> int:
        self._tail.clear()
        try:
            self._child = subprocess.Popen(
                self.cmd, stderr=subprocess.PIPE, env=self._env, start_new_session=True,
                preexec_fn=parent_death.preexec(),
            )
        except OSError as e:
            raise UserError(f"cannot start the training command {self.cmd!r}: {e}; check the "
                            "command after `--` and that it is on PATH") from e
        if watch.requested:
            # The signal arrived while the child was being started, before it could be forwarded.
            assert watch.signal_name is not None  # recorded with the first signal
            self._forward(signal.Signals[watch.signal_name])
        tee = threading.Thread(target=self._tee, args=(self._child.stderr,), daemon=True)
        tee.start()
        code = self._child.wait()
        # A grandchild that inherited the pipe can keep it open; do not wait for it forever.
        tee.join(timeout=5)
        return code

    def _tee(self, stream: IO[bytes]) -> None:
        for raw in stream:
            line = raw.decode(errors="replace")
            self._tail.append(line.rstrip("\n"))
            sys.stderr.write(line)
            sys.stderr.flush()

    def _forward(self, signum: int) -> None:
        child = self._child
        if child is not None and child.returncode is None:
            try:
                os.kill(child.pid, signum)
            except ProcessLookupError:
                pass  # it exited in between; its exit code is what counts

    def _give_up(self, cause: str, step: int | None, streak: int, restarts: int) -> int:
        if step is None:
            where, newer, resume = "no committed checkpoint", "any checkpoint", "starts from step 0"
        else:
            where, newer, resume = f"step {step}", f"a checkpoint newer than step {step}", f"resumes from step {step}"
        if streak >= self.crash_loop_limit:
            why = (f"the child crashed {streak} times in a row without committing {newer} "
                   f"(crash-loop limit {self.crash_loop_limit})")
        else:
            why = f"the child crashed again after {restarts} restarts (--max-restarts {self.max_restarts})"
        tail = "\n".join(f"  | {line}" for line in self._tail) or "  | (no stderr output)"
        message = (f"gave up at {where}: {why}; last exit: {cause}. Last stderr lines of the "
                   f"child:\n{tail}\nFix the cause and run the same command again: it {resume}.")
        if self._events is not None:
            self._events.emit("gave_up", cause=cause, step=step, restarts=restarts,
                              streak=streak, stderr_tail=list(self._tail))
        print(f"{rank_prefix()}error: {message}", file=sys.stderr, flush=True)
        return GAVE_UP


def describe_exit(code: int) -> str:
    """Popen return code -> "exit code N" or "killed by SIGNAME"."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code} ({NAMES[code]})" if code in NAMES else f"exit code {code}"


def _sleep_unless(watch: PreemptionWatch, seconds: float) -> bool:
    """Sleep `seconds` in short slices; False as soon as a stop signal has been received."""
    end = time.monotonic() + seconds
    while not watch.requested:
        left = end - time.monotonic()
        if left <= 0:
            return True
        time.sleep(min(left, 0.1))
    return False


def supervise_self(argv: list[str], max_restarts: int, crash_loop_limit: int, run_dir: str,
                   storage_options: dict[str, Any] | None = None, log_dir: str | None = None,
                   backoff_initial: float = 1.0) -> int:
    """Run `harness <argv>` under a Supervisor, minus the supervisor's own flags.

    For `harness train --max-restarts N`: the child is `python -m harness.cli` with the same
    arguments except `--max-restarts`, `--crash-loop-limit` and `--backoff-initial`; progress is
    read from the checkpoint store at `run_dir`, events go to the run's events file (`events_url`).
    """
    child_argv = strip_flags(argv, ("--max-restarts", "--crash-loop-limit", "--backoff-initial"))
    return Supervisor(
        [sys.executable, "-m", "harness.cli", *child_argv],
        max_restarts=max_restarts,
        crash_loop_limit=crash_loop_limit,
        backoff_initial=backoff_initial,
        progress=checkpoint_progress(run_dir, storage_options),
        events=EventLog(events_url(run_dir, log_dir)),
    ).run()


def checkpoint_progress(run_dir: str, storage_options: dict[str, Any] | None = None) -> Callable[[], int | None]:
    """A progress probe: the step of the newest checkpoint committed at `run_dir` whose files are
    all there at their recorded sizes (`discovery.latest_committed`). It reads no data (the
    supervisor probes before and after every child, and reading a multi-GB checkpoint each time
    would double a restart's reads), and imports no torch; the child's resume verifies every byte
    and falls back past a damaged checkpoint itself."""

    def progress() -> int | None:
        ref = latest_committed(open_location(run_dir, storage_options or None))
        return None if ref is None else ref.step

    return progress


def strip_flags(argv: Sequence[str], flags: Iterable[str]) -> list[str]:
    """`argv` without each `FLAG VALUE` / `FLAG=VALUE` of `flags`."""
    flags = tuple(flags)
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in flags:
            skip = True
        elif not arg.startswith(tuple(f + "=" for f in flags)):
            out.append(arg)
    return out
