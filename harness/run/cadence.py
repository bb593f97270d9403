"""When to checkpoint: `CheckpointClock`, the one place that decides (the Loop asks it after
every step)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Literal


class CheckpointClock:
    """Decides when to checkpoint: every N steps (or an "auto" N), every T minutes, and always at
    the last step.

    `every_steps="auto"` chooses N from measurements (Young/Daly): the loop saves once after its
    first step (`due` is true until a save reported its blocking time), reports the blocking time
    of that save (`saved`), the seconds it took to commit (`committed`; longer than the blocking time for a
    background save) and the seconds of the following steps (`observe_step`). Once that save is
    committed and `AUTO_WARMUP_STEPS` steps were timed after it, the interval is
    `max(sqrt(2 * blocking_s * mtbf_s), persist_s)` seconds, rounded up to whole steps, and
    `report` is called once with the choice and its inputs. The persist bound keeps one save in
    flight at a time. The first save's blocking time includes allocating the staging buffers, so
    it errs long; near the optimum the expected loss c/T + T/(2*MTBF) is flat (at 1.4x the
    optimal interval it is 6% above the minimum), which makes that harmless.

    The triggers read a clock (injectable for tests) and step times, never the training state,
    so they change when checkpoints exist, not what the run computes.
    """

    AUTO_WARMUP_STEPS = 3

    def __init__(self, every_steps: int | Literal["auto"], every_minutes: float, last_step: int,
                 clock: Callable[[], float] = time.monotonic, *, mtbf_s: float = 24 * 3600.0,
                 report: Callable[[dict[str, float | int]], None] | None = None) -> None:
        self.auto = every_steps == "auto"
        self.every_steps = 0 if self.auto else int(every_steps)
        self.every_s = every_minutes * 60.0
        self.last_step = last_step
        self.clock = clock
        self.mtbf_s = mtbf_s
        self.report = report
        self.last_save = clock()
        self.last_saved_step: int | None = None
        self.blocking_s: float | None = None
        self.persist_s: float | None = None
        self.step_times: list[float] = []

    def due(self, step: int) -> bool:
        if step >= self.last_step:
            return True
        if self.auto:
            if self.blocking_s is None:  # the measuring save; a skipped save or a rollback measured nothing
                return True
            if self.every_steps:
                assert self.last_saved_step is not None  # _choose sets every_steps after a save
                if step - self.last_saved_step >= self.every_steps:
                    return True
        elif self.every_steps and step % self.every_steps == 0:
            return True
        return bool(self.every_s) and self.clock() - self.last_save >= self.every_s

    def saved(self, step: int, blocking_s: float | None = None) -> None:
        """A save was taken (or skipped: `blocking_s=None`) at `step`; the next one counts from here."""
        self.last_save = self.clock()
        self.last_saved_step = step
        if self.auto and self.blocking_s is None and blocking_s is not None:
            self.blocking_s = blocking_s

    def committed(self, persist_s: float) -> None:
        """A save took `persist_s` seconds to commit (may be called from the persist thread)."""
        self.persist_s = max(self.persist_s or 0.0, persist_s)

    def observe_step(self, seconds: float) -> None:
        """The seconds of one training step; with "auto", the interval is chosen from these once
        the first save is committed and `AUTO_WARMUP_STEPS` steps were timed after it."""
        if not self.auto or self.every_steps or self.blocking_s is None:
            return
        self.step_times.append(seconds)
        if len(self.step_times) >= self.AUTO_WARMUP_STEPS and self.persist_s is not None:
            self._choose()

    def _choose(self) -> None:
        blocking_s, persist_s = self.blocking_s, self.persist_s
        assert blocking_s is not None and persist_s is not None  # observe_step waits for both
        step_s = sum(self.step_times) / len(self.step_times)
        young_daly_s = math.sqrt(2.0 * blocking_s * self.mtbf_s)
        interval_s = max(young_daly_s, persist_s)
        self.every_steps = max(1, math.ceil(interval_s / step_s)) if step_s > 0 else 1
        if self.report is not None:
            self.report({"every_steps": self.every_steps, "interval_s": interval_s, "young_daly_s": young_daly_s,
                         "blocking_s": blocking_s, "persist_s": persist_s, "step_s": step_s,
                         "mtbf_s": self.mtbf_s, "steps_measured": len(self.step_times)})
