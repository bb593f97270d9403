"""Teacher-student distillation with an EMA of the student, trained by the harness as a task
(docs/tasks.md): a frozen teacher MLP and a smaller student with dropout (two models: one `model`
part, parameters `teacher.*` and `student.*`), the student trained on the teacher's softened
outputs, an exponential moving average of the student's weights kept as extra state (saved,
verified and restored with the rest), updated after every optimizer step.

    harness train examples/distillation.toml

The inputs are generated from each sample's index (no download). The EMA is the task's own state:
`state()` registers it, so a kill loses none of it; left out of `state()`, the harness's
completeness check would refuse to start (a module it could not save).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from harness.task import SeededSamples

FEATURES = 16
CLASSES = 10


def feature_vector(g: torch.Generator) -> torch.Tensor:
    """One feature vector, drawn from `g`."""
    return torch.randn(FEATURES, generator=g)


class Distillation:
    """The task: `task.args` = {teacher_width, student_width, temperature, ema_decay, samples}."""

    def __init__(self, args: dict[str, Any]) -> None:
        self.teacher_width = int(args.get("teacher_width", 64))
        self.student_width = int(args.get("student_width", 16))
        self.temperature = float(args.get("temperature", 2.0))
        self.decay = float(args.get("ema_decay", 0.9))
        self.samples = int(args.get("samples", 4096))
        self.ema: nn.Module | None = None

    def data(self, ctx) -> tuple[SeededSamples, SeededSamples]:
        return (SeededSamples(self.samples, ctx.seed, feature_vector),
                SeededSamples(512, ctx.seed + 1, feature_vector))

    def models(self, ctx) -> dict[str, nn.Module]:
        teacher = nn.Sequential(nn.Linear(FEATURES, self.teacher_width), nn.Tanh(),
                                nn.Linear(self.teacher_width, CLASSES)).requires_grad_(False)
        student = nn.Sequential(nn.Linear(FEATURES, self.student_width), nn.ReLU(), nn.Dropout(0.1),
                                nn.Linear(self.student_width, CLASSES))
        self.ema = copy.deepcopy(student).requires_grad_(False).to(ctx.device)
        return {"teacher": teacher, "student": student}

    def state(self) -> dict[str, nn.Module]:
        return {"ema": self.ema}

    def distill(self, teacher: nn.Module, student: nn.Module, x: torch.Tensor) -> torch.Tensor:
        t = self.temperature
        target = F.log_softmax(teacher(x) / t, dim=1)
        return F.kl_div(F.log_softmax(student(x) / t, dim=1), target, log_target=True, reduction="batchmean") * t * t

    def loss(self, models: nn.ModuleDict, x: torch.Tensor) -> torch.Tensor:
        return self.distill(models["teacher"], models["student"], x)

    def after_step(self, models: nn.ModuleDict, info) -> None:
        for avg, live in zip(self.ema.parameters(), models["student"].parameters(), strict=True):
            avg.lerp_(live, 1 - self.decay)

    def evaluate(self, models: nn.ModuleDict, batches) -> dict[str, float]:
        self.ema.eval()
        student = ema = 0.0
        count = 0
        for x in batches:
            student += float(self.distill(models["teacher"], models["student"], x))
            ema += float(self.distill(models["teacher"], self.ema, x))
            count += 1
        return {"loss": student / count, "ema_loss": ema / count}


def build(args: dict[str, Any]) -> Distillation:
    return Distillation(args)
