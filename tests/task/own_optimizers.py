"""A task with its own optimizers and torch schedulers (tests/e2e/test_optimizer_change.py): Muon on
the 2-D weights at `task.args.lr_muon`, AdamW on the biases at `lr_adamw`, each driven by the torch
scheduler `scheduler` names: "lambda" (a LambdaLR warm-up over OWN_OPTIMIZERS_WARMUP steps, 4 by
default: a constant of the task's code, read from the environment so that a test can change the
code's effect without changing the config), "step" (StepLR, `step_size`, gamma 0.5) or "cosine"
(CosineAnnealingLR, `t_max`). `bundle = "ours"` returns them as optim.MultiOpt / MultiSched."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.lr_scheduler import CosineAnnealingLR, LambdaLR, LRScheduler, StepLR

from optim import MultiOpt, MultiSched, Muon
from tests.task.bad_tasks import Points


class OwnOptimizers:
    def __init__(self, args: dict[str, Any]) -> None:
        self.args = args

    def data(self, ctx):
        return Points(), Points()

    def models(self, ctx):
        return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

    def loss(self, model, batch):
        x, y = batch
        return F.mse_loss(model(x), y)

    def optimizers(self, model, ctx):
        named = list(model.named_parameters())
        optimizers = {"muon": Muon([(n, p) for n, p in named if p.ndim == 2], lr=self.args.get("lr_muon", 0.02)),
                      "adamw": torch.optim.AdamW([(n, p) for n, p in named if p.ndim != 2],
                                                 lr=self.args.get("lr_adamw", 1e-2))}
        schedulers = {name: self.scheduler(opt) for name, opt in optimizers.items()}
        if self.args.get("bundle") == "ours":
            return MultiOpt(optimizers), MultiSched(schedulers)
        return optimizers, schedulers

    def scheduler(self, opt: torch.optim.Optimizer) -> LRScheduler:
        kind = self.args.get("scheduler", "lambda")
        if kind == "step":
            return StepLR(opt, step_size=self.args.get("step_size", 3), gamma=0.5)
        if kind == "cosine":
            return CosineAnnealingLR(opt, T_max=self.args.get("t_max", 8))
        warmup = int(os.environ.get("OWN_OPTIMIZERS_WARMUP", "4"))
        return LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup))


def build(args: dict[str, Any]) -> OwnOptimizers:
    return OwnOptimizers(args)
