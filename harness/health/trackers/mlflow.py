"""MLflow: one MLflow run per harness run, found again by every restart, each step drawn once.

MLflow chooses its own run ids, so the harness run id is kept as the run's tag `harness.run_id`
and every process looks the run up by that tag (`search_runs`) before it creates one: restarts,
requeues and rollbacks continue the same run. MLflow keeps every point it is sent, repeats
included, and has no call that deletes points, so the steps a crash re-runs, already logged with
the same values (resume is bitwise), are not sent again: a process logs only steps after the
highest one the run holds (`rewind` therefore has nothing to do, as for W&B: after a rollback the
anomalous step was never logged and the replayed steps before it equal the logged ones).

Where: `log.mlflow_tracking_uri`, else MLflow's own `MLFLOW_TRACKING_URI`, else a local store in
`LOG_DIR/mlruns` (no server, no network; `mlflow ui --backend-store-uri LOG_DIR/mlruns`). MLflow 3
keeps that file store in maintenance mode and refuses it unless `MLFLOW_ALLOW_FILE_STORE` is set;
the harness sets it for this local default only.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from harness.health.trackers.packages import require
from harness.health.trackers.scalars import scalars

RUN_TAG = "harness.run_id"
SUBDIR = "mlruns"


class MlflowTracker:
    def __init__(self, log_dir: Path, run_id: str, tracking_uri: str | None, experiment: str) -> None:
        require("mlflow", "mlflow", "mlflow")
        from mlflow.tracking import MlflowClient

        uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        if uri is None:
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            uri = (Path(log_dir) / SUBDIR).resolve().as_uri()
        self.client = MlflowClient(tracking_uri=uri)
        found = self.client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found is not None else self.client.create_experiment(experiment)
        runs = self.client.search_runs([experiment_id], filter_string=f"tags.`{RUN_TAG}` = '{run_id}'", max_results=1)
        if runs:
            self.run_id = runs[0].info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
            self.logged_up_to = max((m.step for m in self.client.get_metric_history(self.run_id, "loss")), default=0)
        else:
            self.run_id = self.client.create_run(experiment_id, run_name=run_id, tags={RUN_TAG: run_id}).info.run_id
            self.logged_up_to = 0

    def write(self, record: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        step = int(record["step"])
        if step <= self.logged_up_to:
            return
        values = scalars(record)
        now = int(record.get("time", 0) * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), now, step) for k, v in values.items()])
        self.logged_up_to = step

    def rewind(self, step: int) -> None:
        """Nothing: see the module docstring."""

    def close(self) -> None:
        self.client.set_terminated(self.run_id)
