"""Per-step metrics as JSON lines (`metrics.jsonl` in the run's log dir).

Contract: one JSON object per line with at least `step` and `loss` (plus `lr`, `grad_norm`,
`tokens_per_s`, `time`; evaluation lines carry `eval_loss`). After a resume from step S the file
is cut back to the lines of steps <= S before new lines are appended, so the file of a run that
was interrupted reads exactly like the file of one that was not (up to timing fields).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


class MetricsLog:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = None

    def truncate_after(self, step: int) -> list[dict[str, Any]]:
        """Drop lines of steps after `step` (steps a crashed process ran past its last checkpoint);
        returns the dropped records, so a resumed run can check its re-run steps against them."""
        self.close()
        if not self.path.exists():
            return []
        lines = self.path.read_text().splitlines(keepends=True)
        kept = [line for line in lines if _step_of(line) is not None and _step_of(line) <= step]
        dropped = [json.loads(line) for line in lines if _step_of(line) is not None and _step_of(line) > step]
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(kept))
        os.replace(tmp, self.path)
        return dropped

    def write(self, record: dict[str, Any]) -> None:
        if self._file is None:
            self._file = self.path.open("a")
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """All records of a metrics file (for reports and tests)."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def _step_of(line: str) -> int | None:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None
