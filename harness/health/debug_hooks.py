"""Debug hooks that make a run hang, crash, pause or poison a batch (`[debug]`), to test the health
machinery with real processes. Never set in real runs. The step loop holds them as one
`DebugHooks`; the trainer poisons its losses with `poisoned`.

Each hang happens once per log dir: a marker file remembers it, so the restarted process goes on.
- `debug.hang_in = "step"`: the rank sleeps inside step `hang_at_step` (the other ranks then
  block in that step's collectives).
- `debug.hang_in = "data"`: the data loading hangs. The loop drops a trigger file before step
  `hang_at_step`; the next batch fetched (in a DataLoader worker when data.num_workers > 0, else
  in the trainer) sees it, turns it into the marker and sleeps while its parent lives, so the
  trainer waits on the loader's queue as it would on a worker stuck on a dead mount. With
  prefetching workers the hang is met a few steps later.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Any

from harness import exit_codes
from harness.config import DebugSection


class DebugHooks:
    """The `[debug]` hooks of one training process's step loop, built once. Each call does nothing
    unless its setting asks for it; each is made where in the step its setting acts."""

    def __init__(self, d: DebugSection, log_dir: Path, rank: int, stream: Any) -> None:
        """`stream`: the trainer's data stream; a data hang (`hang_in = "data"`) wraps its source."""
        self.d = d
        self.log_dir = log_dir
        self.rank = rank
        if d.hang_at_step is not None and d.hang_in == "data":
            stream.dataset = StallingSource(stream.dataset, log_dir, d)

    def in_step(self, step: int) -> None:
        """Inside the watched step `step`, before its first batch: arm the data hang that the
        step's fetch meets, or hang here (`hang_in`, `hang_at_step`, `hang_rank`)."""
        arm_data_hang(self.d, self.log_dir, self.rank, step)
        hang_in_step(self.d, self.log_dir, self.rank, step)

    def after_step(self, step: int) -> None:
        """`crash_at_step`: once step `step` is trained and logged, before its evaluation and its
        checkpoint, die as a real crash would (os._exit, or an exception with `crash_mode =
        "raise"`); with `crash_once` only the first time in this log dir."""
        d = self.d
        if d.crash_at_step is None or step != d.crash_at_step:
            return
        marker = self.log_dir / f".crashed-at-{d.crash_at_step}"
        if d.crash_once and marker.exists():
            return
        marker.touch()
        if d.crash_mode == "raise":
            raise RuntimeError(f"debug.crash_at_step: planned crash after step {d.crash_at_step}")
        os._exit(exit_codes.CRASH_EXIT_CODE)

    def end_of_step(self) -> None:
        """`step_sleep_s`: sleep after the step's checkpoint, a window for kill tests."""
        if self.d.step_sleep_s:
            time.sleep(self.d.step_sleep_s)


def poisoned(d: DebugSection, rank: int, batch_no: int, losses: Any) -> Any:
    """`losses` (a tensor) as `[debug]` asks on `rank` for batch `batch_no`: NaN (`nan_at_steps`)
    or 100x (`spike_at_steps`) on `nan_rank`, unchanged elsewhere."""
    if d.nan_rank == rank:
        if batch_no in d.nan_at_steps:
            return losses * math.nan
        if batch_no in d.spike_at_steps:
            return losses * 100.0
    return losses


def _marker(log_dir: Path, d: DebugSection) -> Path:
    return log_dir / f".hung-at-{d.hang_at_step}-rank-{d.hang_rank:05d}"


def _trigger(log_dir: Path, d: DebugSection) -> Path:
    return log_dir / f".hang-data-rank-{d.hang_rank:05d}"


def hang_pending(d: DebugSection, log_dir: Path, rank: int, next_step: int) -> bool:
    return (d.hang_at_step == next_step and d.hang_rank == rank and not _marker(log_dir, d).exists())


def hang_in_step(d: DebugSection, log_dir: Path, rank: int, next_step: int) -> None:
    """`hang_in = "step"`: sleep forever inside step `next_step` (called inside the watched step)."""
    if d.hang_in != "step" or not hang_pending(d, log_dir, rank, next_step):
        return
    _marker(log_dir, d).touch()
    _sleep_while_parent_lives()


def arm_data_hang(d: DebugSection, log_dir: Path, rank: int, next_step: int) -> None:
    """`hang_in = "data"`: drop the trigger the next batch fetch hangs on."""
    if d.hang_in == "data" and hang_pending(d, log_dir, rank, next_step):
        _trigger(log_dir, d).touch()


class StallingSource:
    """A sample source that hangs its fetch once the trigger file exists; otherwise `inner`."""

    def __init__(self, inner: Any, log_dir: Path, d: DebugSection) -> None:
        self.inner = inner
        self.trigger = str(_trigger(log_dir, d))
        self.marker = str(_marker(log_dir, d))
        if hasattr(inner, "windows"):
            self.windows = self._stall_then(inner.windows)

    def _stall_then(self, fetch: Any) -> Any:
        def fetch_or_hang(*args: Any) -> Any:
            self._maybe_hang()
            return fetch(*args)

        return fetch_or_hang

    def _maybe_hang(self) -> None:
        try:
            os.rename(self.trigger, self.marker)  # one fetch wins, in whichever worker
        except FileNotFoundError:
            return
        _sleep_while_parent_lives()

    def __getitem__(self, index: int) -> Any:
        self._maybe_hang()
        return self.inner[index]

    def __getattr__(self, name: str) -> Any:
        if name == "inner":  # while unpickling, before __setstate__
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __getstate__(self) -> dict[str, Any]:
        return {"inner": self.inner, "trigger": self.trigger, "marker": self.marker}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.inner, self.trigger, self.marker = state["inner"], state["trigger"], state["marker"]
        if hasattr(self.inner, "windows"):
            self.windows = self._stall_then(self.inner.windows)


def _sleep_while_parent_lives() -> None:
    """Hang; a loader worker orphaned by the watchdog's exit ends instead of sleeping forever."""
    parent = os.getppid()
    while os.getppid() == parent:
        time.sleep(0.5)
