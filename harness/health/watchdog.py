"""Hang watchdog: a step, save or collective that never returns ends the process, with evidence.

A long job that hangs (a stuck collective, a dead NFS mount, a data worker that never returns)
burns its allocation doing nothing and never reaches the supervisor's crash path. The loop
therefore runs each blocking phase inside `HangWatchdog.watch(phase, step)`. The limit of a
phase is

    max(factor x median of the recent step times, floor_s)      (health.hang_factor, hang_floor_s)

times `scale` (an evaluation reads several batches), and at least `at_least` (a save that has its
own, larger deadline). Until a step has been timed in this process the limit is
`first_step_s`: the first step compiles, starts loader workers and warms caches.

When a phase passes its limit, the watchdog thread, whatever the main thread is doing:
1. dumps every thread's Python stack (`faulthandler`) to `LOG_DIR/hang-rank-NNNNN-pid-P.txt`,
   and on NCCL the pending collectives of the flight recorder (`TORCH_NCCL_TRACE_BUFFER_SIZE`,
   set by the launchers in ops/) to `...-nccl-trace.pkl`;
2. calls `on_hang(report)` (the loop writes a `hang` and an `exit` event);
3. exits with `exit_codes.HUNG` (79) through `os._exit`: the stuck thread cannot be unwound, and
   a clean shutdown would wait for it. The checkpoint commit is atomic, so the previous
   checkpoint stays the newest good one and a restart resumes from it (the supervisor restarts
   79 as a crash, counted toward its crash-loop limit; torchrun restarts the group).

In a group every rank runs its own watchdog: the rank that hangs and the ranks blocked in the
next collective waiting for it all pass their limits and exit 79, each with its own stack dump.

Limits: like `signals.SaveDeadline`, the watchdog is a Python thread and fires only while the
stuck code releases the GIL (sleeps, I/O, collectives, DataLoader queues and torch kernels do);
the median is of this process's steps only, so a restart starts from `first_step_s` again.
"""

from __future__ import annotations

import collections
import faulthandler
import os
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from harness.exit_codes import HUNG
from harness.log import get_logger

log = get_logger(__name__)

STEP_HISTORY = 100  # the median is over this many recent steps


@dataclass(frozen=True)
class HangReport:
    phase: str
    step: int
    limit_s: float
    waited_s: float
    stacks: str  # the path of the stack dump
    nccl_trace: str | None


class HangWatchdog:
    """Arms a deadline around each blocking phase (`watch`); see the module docstring.

    `clock` and `exit` are injectable for tests; `rank` names the dump files."""

    def __init__(self, log_dir: str | os.PathLike, *, factor: float, floor_s: float, first_step_s: float,
                 rank: int = 0, on_hang: Callable[[HangReport], None] | None = None,
                 clock: Callable[[], float] = time.monotonic, exit: Callable[[int], object] = os._exit) -> None:
        self.log_dir = Path(log_dir)
        self.factor, self.floor_s, self.first_step_s = factor, floor_s, first_step_s
        self.rank = rank
        self.on_hang = on_hang
        self._clock, self._exit = clock, exit
        self._steps: collections.deque[float] = collections.deque(maxlen=STEP_HISTORY)
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._armed: tuple[str, int, float, float] | None = None  # phase, step, started, limit
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="hang-watchdog", daemon=True)
        self._thread.start()

    def limit(self, scale: float = 1.0, at_least: float = 0.0) -> float:
        """Seconds a phase may take now (see the module docstring)."""
        if not self._steps:
            base = max(self.first_step_s, self.floor_s)
        else:
            base = max(self.factor * statistics.median(self._steps), self.floor_s)
        return max(base * scale, at_least)

    def observe_step(self, seconds: float) -> None:
        """One training step took `seconds`: the limits follow the median of these."""
        self._steps.append(seconds)

    @contextmanager
    def watch(self, phase: str, step: int, *, scale: float = 1.0, at_least: float = 0.0) -> Iterator[None]:
        """Run the block under a deadline; `step` is the step it works on (named in the dump)."""
        with self._changed:
            self._armed = (phase, step, self._clock(), self.limit(scale, at_least))
            self._changed.notify()
        try:
            yield
        finally:
            with self._changed:
                self._armed = None
                self._changed.notify()

    def close(self) -> None:
        with self._changed:
            self._closed = True
            self._changed.notify()
        self._thread.join()

    def _run(self) -> None:
        with self._changed:
            while not self._closed:
                if self._armed is None:
                    self._changed.wait()
                    continue
                phase, step, started, limit = self._armed
                left = started + limit - self._clock()
                if left > 0:
                    self._changed.wait(left)
                    continue
                break
            else:
                return
        self._fire(phase, step, limit, self._clock() - started)

    def _fire(self, phase: str, step: int, limit: float, waited: float) -> None:
        try:
            stem = self.log_dir / f"hang-rank-{self.rank:05d}-pid-{os.getpid()}"
            stacks = dump_stacks(stem.with_suffix(".txt"))
            trace = dump_nccl_trace(Path(f"{stem}-nccl-trace.pkl"))
            report = HangReport(phase, step, limit, waited, str(stacks), str(trace) if trace else None)
            log.error("hang: no progress within the limit; stacks dumped, exiting for a restart from the last "
                      "checkpoint", phase=phase, step=step, limit_s=round(limit, 1), stacks=str(stacks),
                      exit_code=HUNG)
            if self.on_hang is not None:
                self.on_hang(report)
        finally:  # the exit is the promise: a failing dump or event must not keep a hung process alive
            self._exit(HUNG)


def dump_stacks(path: Path) -> Path:
    """Every thread's Python stack into `path` (faulthandler: works while other threads hold locks)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        f.write(f"hang watchdog: stacks of every thread of pid {os.getpid()}\n")
        f.flush()
        faulthandler.dump_traceback(file=f, all_threads=True)
    return path


def dump_nccl_trace(path: Path) -> Path | None:
    """The NCCL flight recorder's pending and recent collectives (a pickle, the format of
    `torch.distributed.flight_recorder`), when this process uses NCCL and the recorder is on
    (`TORCH_NCCL_TRACE_BUFFER_SIZE` > 0); else None."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_backend() != "nccl":
        return None
    if int(os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE", "0") or 0) <= 0:
        return None
    try:
        # CUDA builds only (a CPU build's stubs lack it: the except below covers its absence).
        from torch._C._distributed_c10d import _dump_nccl_trace  # type: ignore[attr-defined, unused-ignore]

        path.write_bytes(_dump_nccl_trace())
    except Exception as e:  # a private API: its absence must not prevent the exit
        log.warning("could not dump the NCCL flight recorder", error=f"{type(e).__name__}: {e}")
        return None
    return path
