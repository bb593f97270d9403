"""An image classifier trained by the harness as a task (docs/tasks.md): a small CNN on a dataset
of 16x16 images generated from each sample's index (no download), with dropout, trained by the
`[optim]` config's AdamW, evaluated for loss and accuracy.

    harness train examples/image_classifier.toml

Each image shows one of four shapes (a horizontal bar, a vertical bar, a diagonal, a square) at a
random place, with noise; its label is the shape. Sample `i` is a pure function of (seed, i): the
harness's global order draws them, so the run resumes bit for bit after a kill, and at another
world size too (exact elastic mode: the config sets global_batch, batch_size and cpu_threads).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from harness.task import SeededSamples

SIZE = 16
CLASSES = 4


def shape_image(g: torch.Generator) -> dict[str, torch.Tensor]:
    """One image and its label, drawn from `g`."""
    label = int(torch.randint(CLASSES, (), generator=g))
    top, left = (int(v) for v in torch.randint(2, SIZE - 8, (2,), generator=g))
    image = 0.3 * torch.randn(1, SIZE, SIZE, generator=g)
    patch = image[0, top:top + 6, left:left + 6]
    if label == 0:
        patch[2:4, :] += 1.0
    elif label == 1:
        patch[:, 2:4] += 1.0
    elif label == 2:
        patch += torch.eye(6)
    else:
        patch[1:5, 1:5] += 1.0
    return {"image": image, "label": torch.tensor(label)}


class SmallCNN(nn.Module):
    def __init__(self, width: int, dropout: float) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, width, 3, padding=1)
        self.conv2 = nn.Conv2d(width, 2 * width, 3, padding=1)
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(2 * width * (SIZE // 4) ** 2, CLASSES)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(images)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.head(self.drop(x.flatten(1)))


class ImageClassifier:
    """The task: `task.args` = {width, dropout, train_samples, eval_samples}."""

    def __init__(self, args: dict[str, Any]) -> None:
        unknown = set(args) - {"width", "dropout", "train_samples", "eval_samples"}
        if unknown:
            raise ValueError(f"unknown task.args {sorted(unknown)}")
        self.width = int(args.get("width", 8))
        self.dropout = float(args.get("dropout", 0.1))
        self.train_samples = int(args.get("train_samples", 2048))
        self.eval_samples = int(args.get("eval_samples", 256))

    def data(self, ctx) -> tuple[SeededSamples, SeededSamples]:
        return (SeededSamples(self.train_samples, ctx.seed, shape_image),
                SeededSamples(self.eval_samples, ctx.seed + 1, shape_image))

    def models(self, ctx) -> nn.Module:
        return SmallCNN(self.width, self.dropout)

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return F.cross_entropy(model(batch["image"]), batch["label"])

    def evaluate(self, model: nn.Module, batches) -> dict[str, float]:
        loss = correct = seen = 0.0
        for batch in batches:
            logits = model(batch["image"])
            loss += float(F.cross_entropy(logits, batch["label"], reduction="sum"))
            correct += float((logits.argmax(1) == batch["label"]).sum())
            seen += len(batch["label"])
        return {"loss": loss / seen, "accuracy": correct / seen}


def build(args: dict[str, Any]) -> ImageClassifier:
    return ImageClassifier(args)
