"""A run's event log: one JSON object per line in `events.jsonl`, shared by every process of a run.

`EventLog(url).emit(kind, **fields)` appends `{"time": <unix s>, "event": kind, "pid": <pid>,
**fields}` and closes the file again, so the supervisor and its successive children can append
to the same log without coordinating: each line is one write to a file opened for append, which
a local filesystem never interleaves. The schema of each kind is documented where it is read,
in `harness.goodput`.

Where the log lives (`events_url(run_dir, log_dir)`): in `log_dir` when given, else in the run
dir itself when that is a local folder. Object stores cannot append, and rewriting the whole
object per event would be quadratic and racy, so for a remote run dir the log is kept locally in
`runs/<last part of the URL>/`, the same folder the trainer writes its metrics to.
"""

from __future__ import annotations

import json
import os
import posixpath
import time
from collections.abc import Iterator

import fsspec
from fsspec.utils import get_protocol

EVENTS_FILE = "events.jsonl"


def events_url(run_dir: str, log_dir: str | None = None) -> str:
    """The events file of the run at `run_dir` (see the module docstring for remote runs)."""
    if log_dir:
        folder = log_dir
    elif get_protocol(run_dir) in ("file", "local"):
        folder = fsspec.core.strip_protocol(run_dir)
    else:
        folder = os.path.join("runs", run_dir.rstrip("/").rsplit("/", 1)[-1])
    return os.path.join(folder, EVENTS_FILE)


class EventLog:
    """Append-only JSON-lines log at a path or an fsspec URL that supports append (local, memory)."""

    def __init__(self, url: str | os.PathLike) -> None:
        self.url = os.fspath(url)
        fs, path = fsspec.core.url_to_fs(self.url)
        fs.makedirs(posixpath.dirname(path), exist_ok=True)

    def emit(self, kind: str, **fields: object) -> None:
        record = {"time": time.time(), "event": kind, "pid": os.getpid(), **fields}
        line = (json.dumps(record) + "\n").encode()
        with fsspec.open(self.url, "ab") as f:
            f.write(line)

    def read(self) -> list[dict]:
        """Every event so far, in file order; a line that is not JSON is skipped (a log must
        stay readable whatever happened to one writer)."""
        return list(_parse(self.url))


def _parse(url: str) -> Iterator[dict]:
    with fsspec.open(url, "rb") as f:
        for raw in f:
            try:
                yield json.loads(raw)
            except json.JSONDecodeError:
                continue
