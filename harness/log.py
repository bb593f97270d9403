"""Structured logging: human-readable console lines on stderr.

`configure()` is called once by the CLI; library code only calls `get_logger(__name__)`.
Run events (`events.jsonl`) are written by `harness.events.EventLog`.
"""

from __future__ import annotations

import logging
import sys

import structlog
from tqdm import tqdm


def configure(level: str = "info") -> None:
    """Route structlog to stderr with a console renderer (no colours when not a terminal)."""
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="%H:%M:%S"),
            structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty()),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        logger_factory=structlog.WriteLoggerFactory(file=_CurrentStderr()),
        cache_logger_on_first_use=False,
    )


class _CurrentStderr:
    """Writes to whatever `sys.stderr` is at the time of the write: pytest and daemons swap it, and
    a logger bound to a stream that was closed since would raise in the middle of a save.

    Each log line (one `write`: WriteLoggerFactory writes message and newline at once) goes
    through `tqdm.write`, which clears the progress bar of that stream, writes the line and draws
    the bar again below it; a plain write would land on the bar's line, glued to it."""

    def write(self, text: str) -> int:
        tqdm.write(text, file=sys.stderr, end="")
        return len(text)

    def flush(self) -> None:
        sys.stderr.flush()


def get_logger(name: str | None = None) -> structlog.stdlib.BoundLogger:
    return structlog.get_logger(name)
