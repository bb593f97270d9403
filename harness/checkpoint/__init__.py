"""Checkpoints: a training state as safetensors + JSON files, committed atomically to any fsspec URL.

    store = CheckpointStore("runs/a")          # or "s3://bucket/run", "memory://t"
    with store.lease():
        ref = store.save(step, parts, meta={"config": cfg})
    ref = store.latest_good()                   # newest checkpoint that verifies
    meta = store.load(ref, parts)               # streams tensors into the live storage

Modules: format (what the files hold), tensorfile (safetensors read/write), manifest (the commit
record), storage (fsspec + fsync), store (commit, discovery, retention), restore (loading into
live parts), lease (one writer), retention (what to keep), inspect and cli (`harness ckpt`).
"""

from harness.checkpoint.errors import CheckpointError
from harness.checkpoint.format import RANK_PARTS, Snapshot, capture
from harness.checkpoint.store import CheckpointRef, CheckpointStore

__all__ = ["RANK_PARTS", "CheckpointError", "CheckpointRef", "CheckpointStore", "Snapshot", "capture"]
