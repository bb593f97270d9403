"""How a snapshot becomes a committed checkpoint of the run dir: the `Committer` interface.

Every save of a training loop goes snapshot -> saver (saver.py: now or in the background) ->
committer -> `CheckpointStore.committing`, the one commit sequence (begin, write the files,
seal or discard, log, retention). Committers differ only in who writes which file and where:

* `Committer(store)`: this process writes every file into the run dir (`store.commit`).
* `GroupCommit` (group_commit.py): every rank writes its own files, rank 0 seals.
* `LocalFirst` (local_first.py): commit to a local folder, then upload to the run dir in the
  background; the upload is work left running, which the saver polls, finishes and closes
  through the committer (`poll`/`finish`/`close`; nothing to do here).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from harness.checkpoint.discovery import CheckpointRef
from harness.checkpoint.format import Snapshot
from harness.checkpoint.store import CheckpointStore


@dataclass(frozen=True)
class Committed:
    """A finished commit: the checkpoint and the seconds its persist took."""

    ref: CheckpointRef
    persist_s: float
    nbytes: int


class Committer:
    """Commits a snapshot to `store` (the run dir) from this process. `own_shards`: a snapshot
    with sharded parts (FSDP) is committed as this rank's own checkpoint, its shards alone
    (`CheckpointStore.commit`; the local tier)."""

    def __init__(self, store: CheckpointStore, *, own_shards: bool = False) -> None:
        self.store, self.own_shards = store, own_shards

    @property
    def url(self) -> str:
        """The run dir, for messages."""
        return self.store.url

    def __call__(self, step: int, snapshot: Snapshot, *, meta: Mapping[str, Any] | None = None) -> CheckpointRef:
        """Commit `snapshot` as `step`; returns its ref in the run dir. Raises what the store raised."""
        return self.store.commit(step, snapshot, meta=meta, own_shards=self.own_shards)

    def mine(self, snapshot: Snapshot) -> Snapshot:
        """The part of `snapshot` this process writes (what a background save stages): all of it."""
        return snapshot

    def poll(self) -> None:
        """Raise the failure of work a commit left running (none here)."""

    def finish(self, timeout: float | None = None) -> None:
        """Wait for work a commit left running, then raise its failure (none here)."""

    def close(self) -> None:
        """On an error exit: let left work end, log (not raise) its failure (none here)."""
