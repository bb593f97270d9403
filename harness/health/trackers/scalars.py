"""What a tracker draws of a metrics.jsonl record: `scalars(record)`, the one rule every tracker
shares: the step's loss, gradient norm and throughput, every `eval_*` metric a task's evaluation
wrote (the built-in's `eval_loss`), and each learning rate as `lr/<optimizer>/<group>`; finite
numbers only (a NaN/inf loss stops the run, and stays in metrics.jsonl)."""

from __future__ import annotations

import math
from typing import Any

STEP_SCALARS = ("loss", "grad_norm", "tokens_per_s")


def scalars(record: dict[str, Any]) -> dict[str, float]:
    keys = [*STEP_SCALARS, *sorted(k for k in record if k.startswith("eval_"))]
    values = {k: float(record[k]) for k in keys if _number(record.get(k))}
    for group, lrs in (record.get("lr") or {}).items():
        values.update({f"lr/{group}/{i}": float(v) for i, v in enumerate(lrs) if _number(v)})
    return values


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
