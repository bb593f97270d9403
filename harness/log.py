"""Structured logging: human-readable console lines on stderr.

`configure()` is called once by the CLI; library code only calls `get_logger(__name__)`.
Run events (`events.jsonl`) are written by `harness.records.events.EventLog`.

In a launch of several ranks (torchrun), every rank runs the same steps, so rank 0 alone prints
the info lines (steps, checkpoints, the finish); any other rank prints its warnings and errors
(everything at `--log-level debug`), each line prefixed `rank N: ` (`rank_prefix`) unless the
line names its rank already. The CLI's `error: ` line carries the same prefix.
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO, cast

import structlog
from structlog.typing import EventDict, WrappedLogger
from tqdm import tqdm

from harness.topology import topology_from_env


def rank_prefix() -> str:
    """`rank N: ` on a rank other than 0 of a launch of several ranks, else nothing."""
    topo = topology_from_env()
    return f"rank {topo.rank}: " if topo.world_size > 1 and topo.rank != 0 else ""


def configure(level: str = "info") -> None:
    """Route structlog to stderr with a console renderer (no colours when not a terminal); on a
    rank other than 0, info lines are left to rank 0 (see the module docstring)."""
    threshold = getattr(logging, level.upper())
    prefix = rank_prefix()
    if prefix and threshold == logging.INFO:
        threshold = logging.WARNING
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="%H:%M:%S"),
            *([_PrefixRank(prefix)] if prefix else []),
            structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty()),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(threshold),
        # WriteLogger calls only write and flush, which _CurrentStderr has; structlog types the file a TextIO.
        logger_factory=structlog.WriteLoggerFactory(file=cast(TextIO, _CurrentStderr())),
        cache_logger_on_first_use=False,
    )


class _PrefixRank:
    """A structlog processor: `prefix` before the message of a line that does not name its rank."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix

    def __call__(self, logger: WrappedLogger, method: str, event_dict: EventDict) -> EventDict:
        if "rank" not in event_dict:
            event_dict["event"] = f"{self.prefix}{event_dict.get('event', '')}"
        return event_dict


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
