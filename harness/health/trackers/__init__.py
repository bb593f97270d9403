"""Experiment trackers (`[log] trackers`): every step's metrics, from rank 0, where people watch runs.

metrics.jsonl stays the source of truth: a tracker is a copy that may lag or miss points. The
contract of a tracker: `write(record)` (a metrics.jsonl record: `step` and numbers), `rewind(step)`
(the run went back to `step`: later points will be written again and must replace the old ones),
`close()`. `Trackers` fans out to them; a tracker that raises is logged as a warning (once per
streak of failures) and training goes on, so a tracker whose server is down never stops a run.
A tracker whose package is missing is a `UserError` at start: a setting is never ignored silently.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from harness.config import LogSection
from harness.log import get_logger

log = get_logger(__name__)


class Tracker(Protocol):
    """What each tracker (tensorboard, wandb, mlflow) does with the run's scalars."""

    def write(self, record: dict[str, Any]) -> None: ...

    def rewind(self, step: int) -> None: ...

    def close(self) -> None: ...


def open_trackers(cfg: LogSection, log_dir: Path, resumed_step: int, run_id: str) -> Trackers:
    """The trackers named in `[log] trackers`, continuing after `resumed_step` (the config admits
    only the names below)."""
    opened: list[Tracker] = []
    for name in cfg.trackers:
        if name == "tensorboard":
            from harness.health.trackers.tensorboard import TensorBoardTracker

            opened.append(TensorBoardTracker(log_dir, resumed_step))
        if name == "wandb":
            from harness.health.trackers.wandb import WandbTracker

            opened.append(WandbTracker(log_dir, run_id, cfg.wandb_mode, cfg.wandb_project))
        if name == "mlflow":
            from harness.health.trackers.mlflow import MlflowTracker

            opened.append(MlflowTracker(log_dir, run_id, cfg.mlflow_tracking_uri, cfg.mlflow_experiment))
    return Trackers(opened)


class Trackers:
    """Calls every tracker; a failure warns and never propagates (module docstring)."""

    def __init__(self, trackers: list[Tracker]) -> None:
        self.trackers = trackers
        self._failing: set[int] = set()

    def write(self, record: dict[str, Any]) -> None:
        self._each("write", record)

    def rewind(self, step: int) -> None:
        self._each("rewind", step)

    def close(self) -> None:
        self._each("close")

    def _each(self, method: str, *args: Any) -> None:
        for i, tracker in enumerate(self.trackers):
            try:
                getattr(tracker, method)(*args)
            except Exception as e:  # a tracker must never stop training
                if i not in self._failing:
                    log.warning("tracker failed; training goes on (metrics.jsonl has every step)",
                                tracker=type(tracker).__name__, call=method, error=f"{type(e).__name__}: {e}")
                self._failing.add(i)
            else:
                self._failing.discard(i)
