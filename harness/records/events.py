"""A run's event log: one JSON object per line in `events.jsonl`, shared by every process of a run.

`EventLog(url).emit(kind, **fields)` appends `{"time": <unix s>, "event": kind, "pid": <pid>,
**fields}` and closes the file again, so the supervisor and its successive children can append
to the same log without coordinating: each line is one write to a file opened for append, which
a local filesystem never interleaves. The schema of each kind is documented where it is read,
in `harness.records.goodput`.

Where the logs live: `harness.records.run_files.log_dir_for`.

With a `run_id` every record carries it and the log refuses to be appended to when its records
carry another run's (`harness.records.run_id`).
"""

from __future__ import annotations

import json
import os
import posixpath
import time
from typing import Any

import fsspec
from fsspec.utils import get_protocol

from harness.records.jsonlines import records
from harness.records.run_id import RUN_ID_KEY, claim_log

EVENTS_FILE = "events.jsonl"


class EventLog:
    """Append-only JSON-lines log at a path or an fsspec URL that supports append (local, memory);
    its folder is made with the first event. With `run_id` (and `run_dir`, named in the refusal)
    the log must not belong to another run."""

    def __init__(self, url: str | os.PathLike, run_id: str | None = None, run_dir: str = "") -> None:
        self.url = os.fspath(url)
        self.run_id = run_id
        fs, path = fsspec.core.url_to_fs(self.url)
        self._folder: tuple[Any, str] | None = (fs, posixpath.dirname(path))
        if run_id is not None and get_protocol(self.url) in ("file", "local"):
            claim_log(path, run_id, run_dir)

    def emit(self, kind: str, **fields: object) -> None:
        record = {"time": time.time(), "event": kind, "pid": os.getpid(), **fields}
        if self.run_id is not None:
            record[RUN_ID_KEY] = self.run_id
        line = (json.dumps(record) + "\n").encode()
        if self._folder is not None:
            # Made at the first event, not when opened: a reader, or a supervisor whose child stops
            # at once on a user error, leaves no empty folder behind.
            fs, folder = self._folder
            fs.makedirs(folder, exist_ok=True)
            self._folder = None
        with fsspec.open(self.url, "ab") as f:
            f.write(line)

    def read(self) -> list[dict]:
        return read_events(self.url)


def read_events(url: str | os.PathLike) -> list[dict]:
    """Every event of the log at `url` so far, in file order; a line that is not a JSON object
    is skipped (a log must stay readable whatever happened to one writer: `harness.records.jsonlines`).
    Creates nothing (an EventLog makes its folder, to write): FileNotFoundError when there is
    no log, NotADirectoryError when a file stands where its folder should be."""
    return list(records(url))
