"""The local checkpoint tier: frequent checkpoints on node-local disk or tmpfs, for fast recovery.

A crash loses the steps since the last checkpoint; checkpoints to the run dir (S3, a shared file
system) are too slow to take every few steps. `[checkpoint.local]` adds a second tier with its own
cadence, `every_steps`, in a local folder: `DIR/<run id>/` is an ordinary `CheckpointStore` (the
same files, the same atomic commit and BLAKE3 manifest, retention keeping `keep`), written by the
training process itself, synchronously, at the steps where no persistent save is due. A tmpfs
folder (`/dev/shm`) makes it a RAM tier: no other code.

Trust. The run dir stays the source of truth; a local checkpoint is used only when it is newer,
belongs to this run and verifies byte for byte (run/resume.py). Keying the folder by the run id
keeps another run's files out of sight, and every local checkpoint also records the run id in its
meta (`RUN_ID_KEY`, inside state.json, which the manifest hashes), so a copy of another run's
checkpoint put in this run's folder is rejected too (`foreign`).

Timeline. After a resume at step S, local checkpoints past S belong to an abandoned future (a
resume from an older tier, `--resume URL`, a rollback) and are deleted before training goes on,
as local-first staging does (checkpoint/local_first.py).

One process only for now: at world size > 1 (each rank its own folder, the ranks agreeing on a step
every rank holds) it is refused before anything is written (run/process.py).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from harness.checkpoint import CheckpointStore
from harness.checkpoint.commit import Committer
from harness.checkpoint.saver import Saver, Submitted
from harness.config import LocalTierSection
from harness.run_id import RUN_ID_KEY

LOCAL = "local"
PERSISTENT = "persistent"


def local_store(section: LocalTierSection, run_id: str) -> CheckpointStore:
    """The local tier's store for the run `run_id` (`DIR/<run id>`)."""
    return CheckpointStore(f"{section.dir.rstrip('/')}/{run_id}", keep_last=section.keep)


def foreign(meta: Mapping[str, Any], run_id: str) -> str | None:
    """Why a local checkpoint with this saved `meta` is not this run's (None when it is)."""
    saved = meta.get(RUN_ID_KEY)
    if saved == run_id:
        return None
    return f"it was written by run {saved}, not by this run {run_id}"


class LocalTier:
    """Saves the live state every `section.every_steps` steps into the local tier of run `run_id`.

    `resumed_step`: the step the state was restored from (0 when fresh); local checkpoints past it
    are deleted now (module docstring). `per_rank`: as `Saver`'s."""

    def __init__(self, section: LocalTierSection, run_id: str, resumed_step: int,
                 per_rank: Collection[str] = ()) -> None:
        self.every, self.run_id = section.every_steps, run_id
        self.store = local_store(section, run_id)
        for ref in self.store.list():
            if ref.step > resumed_step:
                self.store.delete(ref)
        self.saver = Saver(Committer(self.store), per_rank=per_rank)

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def save(self, step: int, parts: Mapping[str, Any], meta: Mapping[str, Any]) -> Submitted:
        """Commit `parts` as `step` in the local folder, its meta stamped with the run id; returns
        when committed (retention applied)."""
        submitted = self.saver.submit(step, parts, meta={**meta, RUN_ID_KEY: self.run_id})
        assert submitted is not None  # a synchronous saver never skips
        return submitted
