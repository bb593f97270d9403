"""Reading the run's JSON-lines logs (`events.jsonl`, `metrics.jsonl`) whatever happened to them.

A log must stay readable after the worst a machine does to an appended file: a power loss leaves
a tail of NUL bytes or half a line, a bad disk or a stray write leaves random bytes. `records`
yields every line that is a JSON object and skips the rest (not valid UTF-8, not JSON, a JSON
value that is not an object), so `harness report` and `compare` report what survived instead of
a traceback.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import fsspec


def records(url: str | os.PathLike) -> Iterator[dict]:
    """The JSON-object lines of the file at `url` (path or fsspec URL), in file order."""
    with fsspec.open(os.fspath(url), "rb") as f:
        for raw in f:
            record = parse_line(raw)
            if record is not None:
                yield record


def parse_line(raw: bytes | str) -> dict | None:
    """One line as a JSON object, or None when it is not one."""
    try:
        value = json.loads(raw.decode("utf-8") if isinstance(raw, bytes) else raw)
    except ValueError:  # UnicodeDecodeError and JSONDecodeError alike
        return None
    return value if isinstance(value, dict) else None
