"""A task's data as the trainer reads it (`TrainData`): what `data(ctx)` returned, checked and
adapted (harness/data/factory.py's `checked_sources`: map-style sources, or a stateful iterator to
train on), with the task's collate, its vocabulary and identity when its train source declares
them (`vocab_size`, `identity()`: recorded in every checkpoint, a resume on another refused)."""

from __future__ import annotations

from typing import Any

from harness.data.batch import Collate
from harness.data.factory import checked_sources
from harness.data.sources import TrainData

ITEM = "__getitem__(i) -> a sample (a tensor, or a tuple, list or dict of them)"


def task_data(result: Any, task: str, collate: Collate) -> TrainData:
    """`result` of a task's `data(ctx)`: (train, eval), or a `TrainData` (the built-in language
    model's, which reads its own [data] config)."""
    if isinstance(result, TrainData):
        return result
    train, held_out = checked_sources(result, f"task {task!r}: data()", ITEM)
    identity = getattr(train, "identity", None) or getattr(getattr(train, "source", None), "identity", None)
    return TrainData(train, held_out, getattr(train, "vocab_size", None),
                     {"task": identity()} if callable(identity) else None, collate=collate)
