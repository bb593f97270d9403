"""RunConfig: the root of the config, a section per table; [optim] is optim/config.py's OptimConfig
(a union discriminated on `type`). A validator across sections checks what one section alone
cannot (the model's seq_len against the samples'); keys that take effect only beside others are
effects.py's.
`model_args` is what the model factory is called with."""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from harness.config.checkpoint import CheckpointSection
from harness.config.data import DataSection
from harness.config.model import ModelSection
from harness.config.monitoring import DebugSection, HealthSection, LogSection
from harness.config.parallel import ParallelSection
from harness.config.section import Section
from harness.config.task import TaskSection
from harness.config.train import TrainSection
from optim.config import OptimConfig, parse_optim_config


class RunConfig(Section):
    """Everything a run needs. `run_dir` is any fsspec URL; logs go to `log_dir`."""

    run_dir: str = Field(
        "runs/default",
        description="Where checkpoints and run.json go: a local path or any fsspec URL (s3://bucket/prefix).",
    )
    log_dir: str | None = Field(
        None, description="Local folder for events.jsonl/metrics.jsonl; unset = run_dir when local, else runs/<name>."
    )
    task: TaskSection = Field(default_factory=TaskSection, description="[task]: your own training task.")
    model: ModelSection = Field(default_factory=ModelSection, description="[model]: the built-in task's model.")
    data: DataSection = Field(default_factory=DataSection, description="[data]: what the run trains on, the batch.")
    optim: OptimConfig = Field(
        default_factory=lambda: _default_optim(),
        description="Optimizer bundle; `type` selects the arm (default adamw).",
    )
    train: TrainSection = Field(default_factory=TrainSection, description="[train]: the step loop.")
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection,
                                          description="[checkpoint]: when and where checkpoints are written.")
    parallel: ParallelSection = Field(default_factory=ParallelSection,
                                      description="[parallel]: how a model is spread over the ranks.")
    health: HealthSection = Field(default_factory=HealthSection, description="[health]: the hang watchdog.")
    log: LogSection = Field(default_factory=LogSection, description="[log]: experiment trackers.")
    debug: DebugSection = Field(default_factory=DebugSection, description="[debug]: fault hooks for tests.")

    @model_validator(mode="after")
    def _model_fits_the_samples(self) -> RunConfig:
        longest = self.model.args.get("seq_len")
        if isinstance(longest, int) and longest < self.data.seq_len:
            raise ValueError(f"model.args.seq_len = {longest} is shorter than data.seq_len = {self.data.seq_len}: "
                             "remove model.args.seq_len (the model then follows data.seq_len) or raise it")
        return self


def model_args(cfg: RunConfig) -> dict[str, Any]:
    """The dict the model factory is called with: `model.args`, plus `seq_len` = data.seq_len
    unless `model.args` sets it. The math check compares these, so a config that spells out the
    default seq_len and one that leaves it to data.seq_len are the same run."""
    return {"seq_len": cfg.data.seq_len, **cfg.model.args}


def _default_optim() -> OptimConfig:
    return parse_optim_config({})
