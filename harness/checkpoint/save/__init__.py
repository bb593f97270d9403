"""How a training process saves: `open_saver` picks the saver (saver.py, async_saver.py) and its
committer (commit.py, group_commit.py, local_first.py) once; the local tier is local_tier.py."""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Literal

from harness.checkpoint.save.async_saver import AsyncSaver
from harness.checkpoint.save.commit import Committed, Committer
from harness.checkpoint.save.group_commit import GroupCommit
from harness.checkpoint.save.local_first import LocalFirst
from harness.checkpoint.save.saver import Saver, SaverArgs
from harness.checkpoint.store import CheckpointStore
from harness.parallel import distributed


@dataclass(frozen=True)
class SaveSettings:
    """How a training process saves: in the `background` or not (`checkpoint.async_save`),
    `local_dir` (local-first), `when_busy`, `save_deadline_s` and `staging_bytes` (the staging
    ring, `checkpoint.staging_mib`) of `AsyncSaver`; the test hooks `persist_delay_s`
    (`debug.persist_delay_s`) and `fail_rank`, `fail_step` (`debug.fail_save_rank`/`_step`, of
    `GroupCommit`)."""

    background: bool = True
    local_dir: str | None = None
    when_busy: Literal["wait", "skip"] = "wait"
    save_deadline_s: float | None = None
    staging_bytes: int | None = None
    persist_delay_s: float = 0.0
    fail_rank: int | None = None
    fail_step: int | None = None


@dataclass(frozen=True)
class SaveHooks:
    """What a saver tells its caller: `on_commit(Committed)` after each commit (in the background
    thread when saving in the background), `on_slow(step, seconds)` about a slow background save."""

    on_commit: Callable[[Committed], None] | None = None
    on_slow: Callable[[int, float], None] | None = None


def open_saver(store: CheckpointStore, settings: SaveSettings = SaveSettings(), *, per_rank: Collection[str] = (),
               sharded: Collection[str] = (), hooks: SaveHooks = SaveHooks(),
               last_committed: int | None = None) -> Saver:
    """The saver of a training process for the run dir `store`: in the background or not,
    committing through the group when there is one (in the background on a second, gloo, group:
    group_commit.py), else local-first when `settings.local_dir` is set (one process only: the
    caller refuses it with several ranks), else straight into the run dir. `per_rank`, `sharded`,
    `last_committed` are those of `Saver`."""
    s = settings
    if distributed.is_distributed():
        side = None
        if s.background:
            # The side group's collectives give up after the deadline, which a distributed
            # background save has (harness/run/loop.py: `checkpoint.save_deadline_s`).
            assert s.save_deadline_s is not None, "a distributed background save needs save_deadline_s"
            side = distributed.new_side_group(s.save_deadline_s)
        commit: Committer = GroupCommit(store, group=side, fail_rank=s.fail_rank, fail_step=s.fail_step)
    elif s.local_dir is not None:
        commit = LocalFirst(store, s.local_dir)
    else:
        commit = Committer(store)
    common = SaverArgs(rank=distributed.rank(), per_rank=per_rank, sharded=sharded, on_commit=hooks.on_commit,
                       last_committed=last_committed)
    if not s.background:
        return Saver(commit, **common)
    return AsyncSaver(commit, when_busy=s.when_busy, persist_delay_s=s.persist_delay_s,
                      save_deadline_s=s.save_deadline_s, on_slow=hooks.on_slow, agree=distributed.all_reduce_flag,
                      staging_bytes=s.staging_bytes, **common)
