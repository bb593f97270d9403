"""The one way a training loop saves a checkpoint: a `Saver` over a `Committer`.

    saver = open_saver(store, SaveSettings(background=False))   # checkpoint/save/__init__.py
    saver.save(step, parts, meta=meta)     # snapshot, then commit (now, or in the background)
    saver.poll()                           # between steps: raises a failure of earlier work
    saver.finish()                         # everything committed (and, local-first, published)
    saver.close()                          # on an error exit: let good work end, log failures

Two choices make the four kinds of save, each made once, by `open_saver`:
* when: `Saver` commits in the caller's thread (sync); `AsyncSaver` (async_saver.py) copies the
  snapshot into staging buffers and commits in a background thread;
* where: the `Committer` (commit.py): this process into the run dir, every rank of a group
  (`GroupCommit`), or a local folder first with a background upload (`LocalFirst`).
Either way the commit is `CheckpointStore.committing`, the one commit sequence.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any, TypedDict

from harness.checkpoint.errors import failed_save
from harness.checkpoint.format import capture
from harness.checkpoint.save.commit import Committed, Committer


@dataclass(frozen=True)
class Submitted:
    """What `save` did: `blocking_s` is all the time the caller was held up (waiting for the
    previous persist, `waited_s`, plus taking the snapshot, plus the commit when synchronous)."""

    step: int
    blocking_s: float
    waited_s: float
    nbytes: int


class SaverArgs(TypedDict, total=False):
    """The keyword arguments every kind of saver takes (`Saver`'s), for passing them on as one."""

    rank: int
    per_rank: Collection[str]
    sharded: Collection[str]
    on_commit: Callable[[Committed], None] | None
    last_committed: int | None


class Saver:
    """Snapshot-and-commit in the caller's thread, through `commit`.

    `rank`: this process's rank; `per_rank`: the parts each rank saves for itself (the
    snapshot's per-rank files, harness/run/state.py); `sharded`: the parts every rank writes its
    shards of (FSDP; checkpoint/dcp.py). `on_commit(Committed)` runs after each commit.
    `last_committed`: the newest step committed in the run dir as far as this saver knows (what
    a failed save leaves, in its error).
    """

    background = False

    def __init__(self, commit: Committer, *, rank: int = 0, per_rank: Collection[str] = (),
                 sharded: Collection[str] = (), on_commit: Callable[[Committed], None] | None = None,
                 last_committed: int | None = None) -> None:
        self.commit, self.rank, self.per_rank, self.on_commit = commit, rank, frozenset(per_rank), on_commit
        self.last_committed = last_committed
        self.sharded = frozenset(sharded)

    def save(self, step: int, parts: Mapping[str, Any], *, meta: Mapping[str, Any] | None = None,
               must: bool = False) -> Submitted | None:
        """Snapshot `parts` as `step` and commit it; returns once it is committed (local-first:
        committed locally, uploading). A storage error a person must fix is a `CheckpointError`
        saying what is still committed (`failed_save`)."""
        t0 = time.perf_counter()
        snapshot = capture(parts, rank=self.rank, per_rank=self.per_rank, sharded=self.sharded)
        try:
            ref = self.commit(step, snapshot, meta=meta)
        except OSError as e:
            fixable = failed_save(step, e, self.last_committed, self.commit.url)
            if fixable is None:
                raise
            raise fixable from e
        blocking = time.perf_counter() - t0
        self.last_committed = step
        if self.on_commit is not None:
            self.on_commit(Committed(ref, blocking, snapshot.nbytes))
        return Submitted(step, blocking, 0.0, snapshot.nbytes)

    def prepare(self, parts: Mapping[str, Any]) -> None:
        """Make ready, ahead of the first save, what saving `parts` needs (nothing here; the
        background saver's staging memory)."""

    def poll(self) -> None:
        """Raise the failure of work left running (a local-first upload), once."""
        self.commit.poll()

    def finish(self, timeout: float | None = None) -> None:
        """Wait until the newest checkpoint is committed (local-first: published remotely)."""
        self.commit.finish(timeout)

    def close(self) -> None:
        """On an error exit: let good work end, log (not raise) its failure."""
        self.commit.close()
