"""Checkpoints: a training state as safetensors + JSON files, committed atomically to any fsspec URL.

The face of the package: what training (`harness.run`) and the tools use, one way per direction,
whatever the world size, strategy (one process, DDP, FSDP sharded) and tier.

    store = CheckpointStore("runs/a")          # or "s3://bucket/run", "memory://t"
    saver = open_saver(store, SaveSettings())  # sync or async; direct, every rank, or local-first
    with store.lease():
        saver.save(step, parts, meta={"config": cfg})
        saver.finish()                          # committed (local-first: published)
    ref = store.latest_good()                   # newest checkpoint that verifies
    meta = load(store, ref, parts)              # this rank's parts, streamed into the live storage

`locate` / `open_target` read a URL naming a run dir or a checkpoint folder; `verify_target` is
`harness ckpt verify`. The local tier (`LocalTier`, `local_store`, `not_mine`) is a second store
per rank, saved by its own saver and loaded by the same `load`.

Modules, bottom up: discovery (finding committed checkpoints without reading data; no torch),
tensorfile (safetensors read/write), format (what the files hold), manifest (the commit record),
retention (what to keep), lease (one writer), into_live (loading into live parts), loading (a
checkpoint read once, then loaded: the one loader), store (commit sequence, discovery,
retention, reading), prefetch (a checkpoint's files into the page cache while a resume builds its
trainer), target (what a URL names), integrity (`ckpt verify`), dcp and shard_files
(sharded parts), consolidate and diff (whole tensors, checkpoint differences; the `harness
ckpt` command is harness/cli/ckpt.py); save/ (how a training process saves: the saver, its
committers, the local tier). Storage itself (filesystems, S3, retries, faults) is harness/storage.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    # The lazy exports below, as mypy sees them (`X as X`: re-exported, so `from harness.checkpoint
    # import CheckpointStore` type-checks); keep in step with `_EXPORTS`.
    from harness.checkpoint.discovery import CheckpointRef as CheckpointRef, skipped as skipped
    from harness.checkpoint.errors import CheckpointCorrupt as CheckpointCorrupt, CheckpointError as CheckpointError
    from harness.checkpoint.format import (
        WORLD_SIZE_KEY as WORLD_SIZE_KEY,
        Snapshot as Snapshot,
        capture as capture,
        sharded_parts as sharded_parts,
    )
    from harness.checkpoint.integrity import verify_target as verify_target
    from harness.checkpoint.loading import Checkpoint as Checkpoint, Verify as Verify
    from harness.checkpoint.prefetch import Prefetch as Prefetch
    from harness.checkpoint.save import SaveHooks as SaveHooks, SaveSettings as SaveSettings, open_saver as open_saver
    from harness.checkpoint.save.commit import Committed as Committed
    from harness.checkpoint.save.coverage import Coverage as Coverage
    from harness.checkpoint.save.local_recovery import LocalRecovery as LocalRecovery
    from harness.checkpoint.save.local_tier import (
        PERSISTENT as PERSISTENT,
        LocalTier as LocalTier,
        not_mine as not_mine,
    )
    from harness.checkpoint.save.node_folders import LOCAL as LOCAL, PEER as PEER, local_store as local_store
    from harness.checkpoint.save.peer_copies import peer_jump as peer_jump
    from harness.checkpoint.save.saver import Saver as Saver
    from harness.checkpoint.save.writer_cores import place_writers as place_writers
    from harness.checkpoint.store import CheckpointStore as CheckpointStore
    from harness.checkpoint.target import locate as locate, open_target as open_target

# The names below are loaded on first use, so that importing a torch-free module of this package
# (errors, lease, discovery) does not import torch: `harness train` reads checkpoint.errors
# before it checks the config, so a config it refuses costs no torch import (three CPU-seconds), and
# the supervisor watches its child's progress through discovery alone.
_EXPORTS = {"CheckpointCorrupt": "errors", "CheckpointError": "errors", "Snapshot": "format", "capture": "format",
            "sharded_parts": "format", "WORLD_SIZE_KEY": "format", "Checkpoint": "loading", "Verify": "loading",
            "CheckpointRef": "discovery", "skipped": "discovery", "CheckpointStore": "store", "Prefetch": "prefetch",
            "locate": "target", "open_target": "target", "verify_target": "integrity",
            "open_saver": "save", "SaveSettings": "save", "SaveHooks": "save", "Saver": "save.saver",
            "Committed": "save.commit",
            "LocalTier": "save.local_tier", "local_store": "save.node_folders", "not_mine": "save.local_tier",
            "LOCAL": "save.node_folders", "PERSISTENT": "save.local_tier", "PEER": "save.node_folders",
            "peer_jump": "save.peer_copies", "place_writers": "save.writer_cores",
            "LocalRecovery": "save.local_recovery", "Coverage": "save.coverage"}

__all__ = sorted([*_EXPORTS, "load"])


def load(store: CheckpointStore, checkpoint: Checkpoint | CheckpointRef, targets: Mapping[str, Any], *,
         verify: Verify | None = None, skip: Collection[str] = (),
         kept_on_new_rank: Collection[str] = (), one_rank: bool = False,
         shard_copies: Sequence[tuple[CheckpointStore, Checkpoint]] = ()) -> dict[str, Any]:
    """Load `checkpoint` of `store` (a ref, or one opened already: `store.open`) into `targets`
    (name -> object with state_dict/load_state_dict) as this process's rank of its group: the one
    way a checkpoint is loaded (loading.py's `load`, which says what each rank reads and what
    `verify` re-hashes, `one_rank`: a local tier's copy, `shard_copies`: the copies of one step
    whose shards it reads; None: `Verify.NO`). Returns the saved meta."""
    from harness.checkpoint.loading import Verify, load as load_as
    from harness.parallel import distributed

    return load_as(store.loc, checkpoint, targets, rank=distributed.rank(), world=distributed.world(), skip=skip,
                   verify=Verify.NO if verify is None else verify, kept_on_new_rank=kept_on_new_rank,
                   one_rank=one_rank, shard_copies=[(s.loc, c) for s, c in shard_copies])


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{_EXPORTS[name]}"), name)
