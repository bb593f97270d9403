"""Weights & Biases: one W&B run per harness run, continued by every restart.

The W&B run id is the harness run id (created once by the run's first process and kept in
run.json, harness/records/run_id.py), and every process calls `wandb.init(id=run_id, resume="allow")`,
so restarts and requeues continue the same run instead of starting new ones. `log.wandb_mode`
"offline" (the default) writes to `LOG_DIR/wandb` without any network (`wandb sync` uploads it
later); "online" streams. W&B keeps a run's steps increasing: the steps a crash re-runs were
logged already, with the same values (resume is bitwise), and are dropped, so each step is drawn
once; `rewind` therefore has nothing to do (after a rollback the anomalous step was never
logged, and the replayed steps before it equal the logged ones).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from harness.health.trackers.packages import require
from harness.health.trackers.scalars import scalars


class WandbTracker:
    def __init__(self, log_dir: Path, run_id: str, mode: str, project: str) -> None:
        wandb = require("wandb", "wandb", "wandb")
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(id=run_id, resume="allow", mode=mode, project=project, dir=str(log_dir))

    def write(self, record: dict[str, Any]) -> None:
        values = scalars(record)
        if values:
            self.run.log(values, step=int(record["step"]))

    def rewind(self, step: int) -> None:
        """Nothing: see the module docstring."""

    def close(self) -> None:
        self.run.finish()
