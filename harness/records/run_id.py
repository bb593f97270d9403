"""A run's identity, and the rule that one log folder holds the logs of one run only.

The run id is created when a run dir is first trained (`new_run_id`: the UTC start time and 8
random hex digits, from the OS, never from the seeded RNGs) and kept in the run dir's `run.json`
(`"run_id"`); every later process of the same run dir reads it from there. Every record the
trainer writes to `events.jsonl` and `metrics.jsonl` carries it.

`claim_log(path, run_id, run_dir)` is called before a process appends to (or truncates) a log
file: a file whose records carry another run's id is refused with a `UserError`, so two runs can
never mix their metrics or events (a mixed events file made `harness report` invent lost
steps). Records without an id (logs of older versions, the supervisor's own events) are
accepted.
"""

from __future__ import annotations

import itertools
import os
import secrets
import time
from pathlib import Path

from harness.errors import UserError
from harness.records.jsonlines import parse_line

RUN_JSON = "run.json"  # in the run dir: run id, resolved config, environment (harness.records.run_files)
RUN_ID_KEY = "run_id"
# Lines read to find the owner of a log: the first trainer record carries it; earlier lines can
# only be the supervisor's events (no id), and there are few of those.
_OWNER_SCAN_LINES = 1000


def new_run_id() -> str:
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + secrets.token_hex(4)


def log_owner(path: str | os.PathLike) -> tuple[str, str | None] | None:
    """(run id, run dir) of the first record of the file at `path` that has a run id; None when
    the file does not exist or no record has one."""
    path = Path(path)
    if not path.is_file():
        return None
    with path.open("rb") as f:
        for raw in itertools.islice(f, _OWNER_SCAN_LINES):
            record = parse_line(raw)
            if record is not None and RUN_ID_KEY in record:
                return str(record[RUN_ID_KEY]), record.get("run_dir")
    return None


def claim_log(path: str | os.PathLike, run_id: str, run_dir: str) -> None:
    """Refuse to write to the log at `path` when it belongs to another run (see the module docstring)."""
    owner = log_owner(path)
    if owner is None or owner[0] == run_id:
        return
    other_id, other_dir = owner
    of = f" (run dir {other_dir})" if other_dir else ""
    raise UserError(f"{path} holds the logs of another run, {other_id}{of}, not of this run {run_id} "
                    f"(run dir {run_dir}); set log_dir to a folder of its own, or move those logs away")
