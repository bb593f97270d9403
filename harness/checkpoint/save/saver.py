"""The one way a training loop saves a checkpoint: a `Saver` over a `Committer`.

    saver = open_saver(store, background=True, local_dir=None, ...)
    saver.submit(step, parts, meta=meta)   # snapshot, then commit (now, or in the background)
    saver.poll()                           # between steps: raises a failure of earlier work
    saver.finish()                         # everything committed (and, local-first, published)
    saver.close()                          # on an error exit: let good work end, log failures

Two choices make the four kinds of save, each made once, here:
* when: `Saver` commits in the caller's thread (sync); `AsyncSaver` (async_save.py) copies the
  snapshot into staging buffers and commits in a background thread;
* where: the `Committer` (commit.py): this process into the run dir, every rank of a group
  (`GroupCommit`), or a local folder first with a background upload (`LocalFirst`).
Either way the commit is `CheckpointStore.commit_files`, the one commit sequence.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from harness.checkpoint.errors import failed_save
from harness.checkpoint.format import capture
from harness.checkpoint.save.commit import Committed, Committer
from harness.checkpoint.save.group_commit import GroupCommit
from harness.checkpoint.save.local_first import LocalFirst
from harness.checkpoint.store import CheckpointStore
from harness.parallel import distributed


@dataclass(frozen=True)
class Submitted:
    """What `submit` did: `blocking_s` is all the time the caller was held up (waiting for the
    previous persist, `waited_s`, plus taking the snapshot, plus the commit when synchronous)."""

    step: int
    blocking_s: float
    waited_s: float
    nbytes: int


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

    def submit(self, step: int, parts: Mapping[str, Any], *, meta: Mapping[str, Any] | None = None,
               must: bool = False) -> Submitted | None:
        """Snapshot `parts` as `step` and commit it; returns once it is committed (local-first:
        committed locally, uploading). A storage error a person must fix is a `CheckpointError`
        saying what is still committed (`failed_save`)."""
        t0 = time.perf_counter()
        snapshot = capture(parts, rank=self.rank, per_rank=self.per_rank, sharded=self.sharded)
        try:
            ref = self.commit(step, snapshot, meta=meta)
        except OSError as e:
            raise failed_save(step, e, self.last_committed, self.commit.url) or e
        blocking = time.perf_counter() - t0
        self.last_committed = step
        if self.on_commit is not None:
            self.on_commit(Committed(ref, blocking, snapshot.nbytes))
        return Submitted(step, blocking, 0.0, snapshot.nbytes)

    def poll(self) -> None:
        """Raise the failure of work left running (a local-first upload), once."""
        self.commit.poll()

    def finish(self, timeout: float | None = None) -> None:
        """Wait until the newest checkpoint is committed (local-first: published remotely)."""
        self.commit.finish(timeout)

    def close(self) -> None:
        """On an error exit: let good work end, log (not raise) its failure."""
        self.commit.close()


def open_saver(store: CheckpointStore, *, background: bool, local_dir: str | None = None,
               when_busy: Literal["wait", "skip"] = "wait", save_deadline_s: float | None = None,
               per_rank: Collection[str] = (), sharded: Collection[str] = (),
               on_commit: Callable[[Committed], None] | None = None,
               on_slow: Callable[[int, float], None] | None = None, persist_delay_s: float = 0.0,
               fail_rank: int | None = None, fail_step: int | None = None,
               last_committed: int | None = None) -> Saver:
    """The saver of a training process for the run dir `store`: in the `background` or not,
    committing through the group when there is one (in the background on a second, gloo, group:
    distributed_commit.py), else local-first when `local_dir` is set (one process only: the
    caller refuses it with several ranks), else straight into the run dir. The other arguments
    are those of `Saver` / `AsyncSaver`; `fail_rank`, `fail_step` those of `GroupCommit`."""
    from harness.checkpoint.save.async_saver import AsyncSaver  # async_save builds on Saver

    if distributed.is_distributed():
        side = distributed.new_side_group(save_deadline_s) if background else None
        commit: Committer = GroupCommit(store, group=side, fail_rank=fail_rank, fail_step=fail_step)
    elif local_dir is not None:
        commit = LocalFirst(store, local_dir)
    else:
        commit = Committer(store)
    common = dict(rank=distributed.rank(), per_rank=per_rank, sharded=sharded, on_commit=on_commit,
                  last_committed=last_committed)
    if not background:
        return Saver(commit, **common)
    return AsyncSaver(commit, when_busy=when_busy, persist_delay_s=persist_delay_s, save_deadline_s=save_deadline_s,
                      on_slow=on_slow, agree=distributed.all_reduce_flag, **common)
