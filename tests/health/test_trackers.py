"""Trackers: TensorBoard event files and the MLflow run read back after SIGKILLs hold each step
once, with the loss metrics.jsonl has; W&B keeps one run id; a failing tracker warns and training
goes on; an unknown one is a one-line config error."""

import json
import math

from structlog.testing import capture_logs
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from harness.health.trackers import Trackers
from procs import ENV, TINY, assert_one_line_error, harness, kill_at_step, losses

TENSORBOARD = ["--set", 'log.trackers=["tensorboard"]']


def scalars(run_dir, tag: str) -> list[tuple[int, float]]:
    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_tensorboard_after_two_kills_shows_every_step_once(tmp_path):
    run = tmp_path / "run"
    args = ["train", str(TINY), "--run-dir", str(run), *TENSORBOARD]
    for step in (6, 10):  # after checkpoints 4 and 8: steps 5-6 and 9-10 are run twice
        assert kill_at_step(args, run, step) != 0
    harness(*args, check=True)
    assert len(list((run / "tensorboard").glob("events.out.tfevents.*"))) >= 3
    points = scalars(run, "loss")
    assert [step for step, _ in points] == list(range(1, 13))
    logged = losses(run)
    assert all(math.isclose(value, logged[step], rel_tol=1e-6) for step, value in points)  # float32 in TensorBoard
    assert [step for step, _ in scalars(run, "eval_loss")] == [12]


def test_a_rollback_rewinds_tensorboard_too(tmp_path):
    run = tmp_path / "run"
    harness("train", str(TINY), "--run-dir", str(run), *TENSORBOARD, "--set", 'train.on_anomaly="rollback"',
            "--set", "debug.nan_at_steps=[7]", check=True)
    assert [step for step, _ in scalars(run, "loss")] == list(range(1, 13))


def test_wandb_offline_continues_one_run_across_kills(tmp_path):
    """Two processes (a SIGKILL), one W&B run: each process's offline run folder carries the
    harness run id, without any network."""
    run = tmp_path / "run"
    args = ["train", str(TINY), "--run-dir", str(run), "--set", 'log.trackers=["wandb"]']
    env = {**ENV, "WANDB_SILENT": "true"}
    assert kill_at_step(args, run, 6, env=env) != 0
    harness(*args, check=True, env=env)
    run_id = json.loads((run / "run.json").read_text())["run_id"]
    folders = sorted(p.name for p in (run / "wandb").glob("offline-run-*"))
    assert len(folders) == 2 and all(name.endswith("-" + run_id) for name in folders), (run_id, folders)


def test_mlflow_after_two_kills_and_a_rollback_holds_one_run_with_every_step_once(tmp_path, monkeypatch):
    """Three processes (two SIGKILLs), then a rollback in the last: one MLflow run in the local
    store, found again by its tag, its loss history each step once with metrics.jsonl's values."""
    from mlflow.tracking import MlflowClient

    run = tmp_path / "run"
    args = ["train", str(TINY), "--run-dir", str(run), "--set", 'log.trackers=["mlflow"]',
            "--set", 'train.on_anomaly="rollback"', "--set", "debug.nan_at_steps=[11]"]
    for step in (6, 10):  # after checkpoints 4 and 8: steps 5-6 and 9-10 are run twice
        assert kill_at_step(args, run, step) != 0
    harness(*args, check=True)
    run_id = json.loads((run / "run.json").read_text())["run_id"]
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # as the tracker does for this local store
    client = MlflowClient(tracking_uri=(run / "mlruns").resolve().as_uri())
    (found,) = client.search_runs([client.get_experiment_by_name("harness").experiment_id])
    assert found.data.tags["harness.run_id"] == run_id and found.info.status == "FINISHED"
    history = client.get_metric_history(found.info.run_id, "loss")
    assert [m.step for m in history] == list(range(1, 13))
    logged = losses(run)
    assert all(math.isclose(m.value, logged[m.step], rel_tol=1e-12) for m in history)


class Broken:
    def write(self, record):
        raise ConnectionError("tracker server unreachable")

    rewind = close = write


class Recording:
    def __init__(self):
        self.records = []

    def write(self, record):
        self.records.append(record)

    def rewind(self, step):
        pass

    def close(self):
        pass


def test_a_failing_tracker_warns_once_per_streak_and_the_others_go_on():
    good = Recording()
    trackers = Trackers([Broken(), good])
    with capture_logs() as logs:
        for step in (1, 2, 3):
            trackers.write({"step": step, "loss": 1.0})
        trackers.close()
    assert [r["step"] for r in good.records] == [1, 2, 3]
    (warning,) = [r for r in logs if r["event"].startswith("tracker failed; training goes on")]
    assert warning["log_level"] == "warning" and warning["error"] == "ConnectionError: tracker server unreachable"


def test_an_unknown_tracker_is_a_one_line_config_error(tmp_path):
    proc = harness("train", str(TINY), "--run-dir", str(tmp_path / "run"), "--set", 'log.trackers=["wandb2"]')
    assert_one_line_error(proc, "log.trackers.0: Input should be 'tensorboard', 'wandb' or 'mlflow'")
