"""[health], [log] and [debug]: what watches a run (the hang watchdog, experiment trackers) and the
fault hooks that test the harness. None of them changes the numbers a run produces (FREE_FIELDS)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from harness.config.section import Section


class HealthSection(Section):
    """The hang watchdog (harness/health/watchdog.py); none of these change the math."""

    hang_watchdog: bool = Field(
        True,
        description=(
            "Exit with code 79 (HUNG, restarted like a crash) after dumping every thread's stack to the log dir when a "
            "step, save, evaluation or collective takes longer than max(hang_factor x the median step time, "
            "hang_floor_s)."
        ),
    )
    hang_factor: float = Field(
        20.0, gt=1.0,
        description="A phase may take this many median step times (an evaluation: per eval batch over grad_accum).",
    )
    hang_floor_s: float = Field(
        600.0, gt=0.0,
        description="Lower bound of every limit, in seconds: covers slow checkpoints and stalls that are not hangs.",
    )
    first_step_s: float = Field(
        1800.0, gt=0.0,
        description=(
            "Limit for phases before this process has timed a step (compilation, loader workers starting, cache "
            "warm-up)."
        ),
    )


class LogSection(Section):
    """Where metrics go besides metrics.jsonl (which stays the source of truth)."""

    trackers: list[Literal["tensorboard", "wandb", "mlflow"]] = Field(
        default_factory=list,
        description=(
            "Experiment trackers fed by rank 0 with every step's metrics: \"tensorboard\" (pip install "
            "'harness[tensorboard]'; event files in LOG_DIR/tensorboard, re-run steps replace the old points), "
            "\"wandb\" (pip install 'harness[wandb]'; one W&B run per harness run, its id the run id, continued by "
            "every restart), \"mlflow\" (pip install 'harness[mlflow]'; one MLflow run per harness run, found again by "
            "its tag harness.run_id). A tracker that fails warns and never stops training."
        ),
    )
    wandb_mode: Literal["offline", "online"] = Field(
        "offline",
        description=(
            "W&B: offline = write LOG_DIR/wandb only (no network; `wandb sync` uploads it), online = stream to the W&B "
            "server."
        ),
    )
    wandb_project: str = Field("harness", description="W&B project of the run.")
    mlflow_tracking_uri: str | None = Field(
        None,
        description=(
            "MLflow: the tracking server or store (e.g. http://mlflow:5000); unset = MLFLOW_TRACKING_URI from the "
            "environment, else a local store in LOG_DIR/mlruns."
        ),
    )
    mlflow_experiment: str = Field("harness", description="MLflow experiment of the run (created when missing).")


class DebugSection(Section):
    """Fault hooks for tests of the harness itself; never set in real runs."""

    crash_at_step: int | None = Field(
        None, description="Crash the process after this optimizer step (before its checkpoint)."
    )
    crash_mode: Literal["exit", "raise"] = Field(
        "exit", description="exit = os._exit(13); raise = an uncaught exception."
    )
    crash_once: bool = Field(True, description="Crash only the first time (a marker file in the log dir remembers).")
    step_sleep_s: float = Field(0.0, ge=0.0, description="Sleep after each step, to give kill tests a window.")
    persist_delay_s: float = Field(
        0.0, ge=0.0,
        description=(
            "Sleep this long in the background persist before writing (async_save), and before each background peer "
            "exchange of the local tier, to give tests a window in which a save or a peer copy is in flight."
        ),
    )
    fail_save_rank: int | None = Field(
        None, ge=0,
        description=(
            "With world size > 1: this rank fails half-way through writing its part of a checkpoint (at "
            "`fail_save_step`, or at every save), to test that no rank commits then."
        ),
    )
    fail_save_step: int | None = Field(
        None, ge=0, description="The step at which `fail_save_rank` fails its save; unset = every save."
    )
    hang_at_step: int | None = Field(
        None, ge=1,
        description=(
            "Hang forever (once: a marker in the log dir) while working on this step, where `hang_in` says: the step "
            "itself, or the data loading of it (in a loader worker when data.num_workers > 0)."
        ),
    )
    hang_in: Literal["step", "data"] = Field("step", description="Where `hang_at_step` hangs.")
    hang_rank: int = Field(0, ge=0, description="The rank that hangs (`hang_at_step`).")
    nan_at_steps: list[Annotated[int, Field(ge=1)]] = Field(
        default_factory=list,
        description=(
            "Poison the batches that these steps draw in a run without skips (step N's worth of batches): their loss "
            "becomes NaN on `nan_rank`. A rollback that skips such a batch does not meet it again."
        ),
    )
    spike_at_steps: list[Annotated[int, Field(ge=1)]] = Field(
        default_factory=list,
        description=(
            "Like `nan_at_steps`, but the loss of those batches is multiplied by 100 (a loss spike; the gradients are "
            "unchanged)."
        ),
    )
    nan_rank: int = Field(0, ge=0, description="The rank whose loss `nan_at_steps` and `spike_at_steps` poison.")
    sample_log: bool = Field(
        False,
        description=(
            "Each rank appends the sample ids of every batch to LOG_DIR/samples-rank-NNNNN.jsonl, to test the data "
            "split across ranks and world sizes."
        ),
    )

