"""`load_task(cfg)`: the task a run trains, bound (bound.py): `task.factory`'s, called with
`task.args` (an exception of the factory is one line naming it and its args, as a model factory's),
or the built-in language model; `task_context`, what its builders get."""

from __future__ import annotations

import torch

from harness.config import RunConfig
from harness.models import call_factory, load_factory
from harness.task.bound import BoundTask
from harness.task.contract import TaskContext
from harness.task.language_model import NAME, LanguageModel

EXAMPLE = "my_package.task:build"


def load_task(cfg: RunConfig) -> BoundTask:
    path = cfg.task.factory
    if path is None:
        return BoundTask(LanguageModel(cfg), NAME)
    task = call_factory(load_factory(path, "task factory", EXAMPLE, cfg.task.code_folder), path, "task factory",
                        "task.args", cfg.task.args, dict(cfg.task.args))
    return BoundTask(task, path)


def task_context(cfg: RunConfig, rank: int, world_size: int, device: torch.device) -> TaskContext:
    """What the task's builders get in this process (contract.py)."""
    return TaskContext(args=cfg.task.args, seed=cfg.train.seed, rank=rank, world_size=world_size, device=device,
                       steps=cfg.train.steps)
