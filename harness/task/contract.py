"""The task contract: what a user's training task gives the harness, and what the harness gives it
(docs/tasks.md). One interface serves the built-in language model (language_model.py) and every
user's task: the production loop (harness/run/trainer.py) knows no other.

A task is any object with these methods (harness/task/bound.py fills in the optional ones):

Required
- `data(ctx) -> (train, eval)`: map-style sample sources (`num_samples` or `__len__`,
  `__getitem__(i)` -> any nest of tensors, optional `sample_id(i)`: default `i`), or, for
  training, a stateful iterator (`state_dict` / `load_state_dict`, harness/data/factory.py).
  The order, the rank split, loader workers and the epoch position stay the harness's: sample `i`
  must be a pure function of `i`.
- `models(ctx) -> nn.Module | {name: nn.Module}`: built from the generators as seeded (the run
  seed), before any sharding; several models are one `model` part (an `nn.ModuleDict`: parameter
  names `name.param`).
- `loss(models, batch) -> Tensor`: one micro-batch's scalar loss; the harness does the backward,
  accumulation, reductions, clipping, non-finite checks and the optimizer step. Or instead:
- `step(models, optim, batch, info) -> StepLoss | Tensor`: a whole step's micro-batch, for
  optimizers that step at their own cadences: the loss to backpropagate and the optimizers that
  step after this optimizer step (`StepLoss.optimizers`; every micro-batch of a step must name
  the same); the others' gradients are dropped and their schedulers do not advance.

Optional
- `optimizers(models, ctx) -> ({name: optimizer}, {name: scheduler})` (or an `optim.MultiOpt` /
  `optim.MultiSched`): any torch optimizer whose state keys are known (optim/bundle.py), the
  `optim/` ones, each scheduler a torch `LRScheduler` stepped without a metric (ours included)
  named after the optimizer it drives; None (the default): the `[optim]` config's bundle over the
  models' named parameters. On resume their settings are the ones built now, compared with the
  checkpoint's (optim/schedulers.py).
- `evaluate(models, batches) -> {metric: float}`: written as `eval_<metric>` to metrics.jsonl
  and the trackers; default `{"loss": mean of loss over the eval batches}`.
- `state() -> {name: stateful}`: extra state saved, verified and restored with the rest (an
  EMA, a replay buffer, a counter); each a module or an object with `state_dict` /
  `load_state_dict` whose state is dicts, lists, tensors and JSON scalars.
- `after_step(models, info)`: after each optimizer step, without gradients (an EMA update).
- `collate(samples) -> batch`: default torch's `default_collate`.
- `tokens(batch) -> int`: what `tokens_per_s` counts; default the samples.

Everything a task draws from the global torch generators inside `loss` / `step` (dropout) is
the harness's to save and restore; a generator or other state of its own that no part saves is
refused at start (harness/repro/completeness.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class TaskContext:
    """What a task's builders get: `args` (task.args), the run `seed`, this process's `rank` of
    `world_size`, its `device` and the run's total `steps` (for a schedule)."""

    args: Mapping[str, Any]
    seed: int
    rank: int
    world_size: int
    device: torch.device
    steps: int


@dataclass(frozen=True)
class StepInfo:
    """Where a micro-batch lies: the optimizer `step` being trained (1-based), the micro-batch's
    index among the step's `micro_batches` (over all ranks, in the global order of the samples),
    and the process's `rank` of `world_size`. In `after_step`: `stepped`, the optimizers that
    stepped."""

    step: int
    micro_batch: int
    micro_batches: int
    rank: int
    world_size: int
    stepped: tuple[str, ...] = ()


@dataclass(frozen=True)
class StepLoss:
    """What a task's `step` returns: the `loss` to backpropagate and the `optimizers` that step at
    the end of this optimizer step (None: all)."""

    loss: torch.Tensor
    optimizers: tuple[str, ...] | None = None


def batch_samples(batch: Any) -> int:
    """The samples in a collated batch: the first dimension of the first tensor of the nest."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    values = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (tuple, list)) else ()
    return next((batch_samples(v) for v in values if isinstance(v, (torch.Tensor, Mapping, tuple, list))), 0)
