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
from typing import Any, TextIO

from harness.records.jsonlines import parse_line, records
from harness.records.run_id import RUN_ID_KEY, claim_log


class MetricsLog:
    """With `run_id` (and `run_dir`, named in the refusal) every record carries the id and the
    file must not belong to another run (`harness.records.run_id`)."""

    def __init__(self, path: str | Path, run_id: str | None = None, run_dir: str = "") -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.run_id = run_id
        if run_id is not None:
            claim_log(self.path, run_id, run_dir)
        self._file: TextIO | None = None

    def truncate_after(self, step: int) -> list[dict[str, Any]]:
        """Drop lines of steps after `step` (steps a crashed process ran past its last checkpoint);
        returns the dropped records, so a resumed run can check its re-run steps against them."""
        self.close()
        if not self.path.exists():
            return []
        # Lines that are not JSON objects (a power loss's NUL tail, stray bytes) are dropped here.
        lines = self.path.read_bytes().splitlines(keepends=True)
        kept = [line for line in lines if (at := _step_of(line)) is not None and at <= step]
        dropped = [parsed for line in lines
                   if (at := _step_of(line)) is not None and at > step and (parsed := parse_line(line)) is not None]
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_bytes(b"".join(line if line.endswith(b"\n") else line + b"\n" for line in kept))
        os.replace(tmp, self.path)
        return dropped

    def write(self, record: dict[str, Any]) -> None:
        if self._file is None:
            self._file = self.path.open("a")
        if self.run_id is not None:
            record = {**record, RUN_ID_KEY: self.run_id}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """All records of a metrics file (for reports and tests); lines that are not JSON objects
    are skipped (`harness.records.jsonlines`)."""
    return list(records(path))


def _step_of(line: bytes) -> int | None:
    record = parse_line(line)
    try:
        return None if record is None else int(record["step"])
    except (ValueError, KeyError, TypeError):
        return None
