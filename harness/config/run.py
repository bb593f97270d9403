"""RunConfig: the root of the config, a section per table; [optim] is optim/config.py's OptimConfig
(a union discriminated on `type`). Validators across sections check what one section alone cannot
(the model's seq_len against the samples'; a task factory against the built-in model's keys).
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
from harness.config.task import LANGUAGE_MODEL_KEYS, TaskSection
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
    task: TaskSection = Field(default_factory=TaskSection)
    model: ModelSection = Field(default_factory=ModelSection)
    data: DataSection = Field(default_factory=DataSection)
    optim: OptimConfig = Field(
        default_factory=lambda: _default_optim(),
        description="Optimizer bundle; `type` selects the arm (default adamw).",
    )
    train: TrainSection = Field(default_factory=TrainSection)
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection)
    parallel: ParallelSection = Field(default_factory=ParallelSection)
    health: HealthSection = Field(default_factory=HealthSection)
    log: LogSection = Field(default_factory=LogSection)
    debug: DebugSection = Field(default_factory=DebugSection)

    @model_validator(mode="after")
    def _model_fits_the_samples(self) -> RunConfig:
        longest = self.model.args.get("seq_len")
        if isinstance(longest, int) and longest < self.data.seq_len:
            raise ValueError(f"model.args.seq_len = {longest} is shorter than data.seq_len = {self.data.seq_len}: "
                             "remove model.args.seq_len (the model then follows data.seq_len) or raise it")
        return self

    @model_validator(mode="after")
    def _task_or_language_model(self) -> RunConfig:
        if self.task.factory is None:
            return self
        for section, keys in LANGUAGE_MODEL_KEYS.items():
            # A key set to its default changes nothing (and a saved config, dumped whole, sets them all).
            part = getattr(self, section)
            defaults = type(part)()
            given = sorted(k for k in part.model_fields_set & set(keys) if getattr(part, k) != getattr(defaults, k))
            if given:
                raise ValueError(f"{section}.{given[0]} is a setting of the built-in language model, which "
                                 f"task.factory = {self.task.factory!r} replaces: remove it (the task builds its own "
                                 "models and data; pass what it needs in task.args)")
        return self


def model_args(cfg: RunConfig) -> dict[str, Any]:
    """The dict the model factory is called with: `model.args`, plus `seq_len` = data.seq_len
    unless `model.args` sets it. The math check compares these, so a config that spells out the
    default seq_len and one that leaves it to data.seq_len are the same run."""
    return {"seq_len": cfg.data.seq_len, **cfg.model.args}


def _default_optim() -> OptimConfig:
    return parse_optim_config({})
