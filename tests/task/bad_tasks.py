"""Task factories that break the task contract one way each (test_task_api.py), on a small
regression task that keeps it (`build`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from harness.task import StepLoss


class Points:
    def __len__(self) -> int:
        return 256

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(4, generator=torch.Generator().manual_seed(i))
        return x, x.sum(0, keepdim=True)


class Regression:
    def data(self, ctx):
        return Points(), Points()

    def models(self, ctx):
        return nn.Linear(4, 1)

    def loss(self, model, batch):
        x, y = batch
        return F.mse_loss(model(x), y)


def build(args):
    return Regression()


class NoModels(Regression):
    models = None


class NoLoss:
    def data(self, ctx):
        return Points(), Points()

    def models(self, ctx):
        return nn.Linear(4, 1)


class TakesAName(Regression):
    def state(self):
        return {"model": nn.Linear(1, 1)}


class ForgetsItsEma(Regression):
    def models(self, ctx):
        model = super().models(ctx)
        self.ema = nn.Linear(4, 1)
        return model


class Undecided(Regression):
    """Two optimizers; its micro-batches name different ones within a step."""

    def models(self, ctx):
        return {"a": nn.Linear(4, 1), "b": nn.Linear(4, 1)}

    def optimizers(self, models, ctx):
        return {name: torch.optim.SGD(m.parameters(), lr=0.1) for name, m in models.items()}, {}

    def step(self, models, optim, batch, info):
        x, y = batch
        name = "ab"[info.micro_batch % 2]
        return StepLoss(F.mse_loss(models[name](x), y), optimizers=(name,))


class PositionalMultiOpt:
    """A project's own MultiOpt, as the team reference's: its optimizers in a list."""

    def __init__(self, optimizers):
        self.optimizers = list(optimizers)


class ForeignBundle(Regression):
    """Returns its optimizers as its own MultiOpt, not {name: optimizer} nor optim.MultiOpt."""

    def optimizers(self, model, ctx):
        return PositionalMultiOpt([torch.optim.SGD(model.parameters(), lr=0.1)]), None


class SchedulesAnother(Regression):
    """Names a scheduler after an optimizer it does not drive."""

    def models(self, ctx):
        return {"a": nn.Linear(4, 1), "b": nn.Linear(4, 1)}

    def optimizers(self, models, ctx):
        optimizers = {name: torch.optim.SGD(m.parameters(), lr=0.1) for name, m in models.items()}
        return optimizers, {"a": torch.optim.lr_scheduler.StepLR(optimizers["b"], 2)}

    def loss(self, models, batch):
        x, y = batch
        return F.mse_loss(models["a"](x) + models["b"](x), y)


def broken(args):
    raise RuntimeError("no such dataset")


def no_models(args):
    return NoModels()


def no_loss(args):
    return NoLoss()


def takes_a_name(args):
    return TakesAName()


def forgets_its_ema(args):
    return ForgetsItsEma()


def undecided(args):
    return Undecided()


def foreign_bundle(args):
    return ForeignBundle()


def schedules_another(args):
    return SchedulesAnother()
