"""How a training process saves: `open_saver` picks the saver (saver.py, async_saver.py) and its
committer (commit.py, group_commit.py, local_first.py) once; the local tier is local_tier.py."""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Literal

from harness.checkpoint.save.async_saver import AsyncSaver
from harness.checkpoint.save.commit import Committed, Committer
from harness.checkpoint.save.group_commit import GroupCommit
from harness.checkpoint.save.local_first import LocalFirst
from harness.checkpoint.save.saver import Saver
from harness.checkpoint.store import CheckpointStore
from harness.parallel import distributed


def open_saver(store: CheckpointStore, *, background: bool, local_dir: str | None = None,
               when_busy: Literal["wait", "skip"] = "wait", save_deadline_s: float | None = None,
               per_rank: Collection[str] = (), sharded: Collection[str] = (),
               on_commit: Callable[[Committed], None] | None = None,
               on_slow: Callable[[int, float], None] | None = None, persist_delay_s: float = 0.0,
               fail_rank: int | None = None, fail_step: int | None = None,
               last_committed: int | None = None) -> Saver:
    """The saver of a training process for the run dir `store`: in the `background` or not,
    committing through the group when there is one (in the background on a second, gloo, group:
    group_commit.py), else local-first when `local_dir` is set (one process only: the
    caller refuses it with several ranks), else straight into the run dir. The other arguments
    are those of `Saver` / `AsyncSaver`; `fail_rank`, `fail_step` those of `GroupCommit`."""
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
