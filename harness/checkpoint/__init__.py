"""Checkpoints: a training state as safetensors + JSON files, committed atomically to any fsspec URL.

    store = CheckpointStore("runs/a")          # or "s3://bucket/run", "memory://t"
    with store.lease():
        ref = store.save(step, parts, meta={"config": cfg})
    ref = store.latest_good()                   # newest checkpoint that verifies
    meta = store.load(ref, parts)               # streams tensors into the live storage

Modules, bottom up: filesystem (URL -> fsspec filesystem), location (durable writes and hashed
reads on a Location), digest, tensorfile (safetensors read/write), format (what the files hold),
manifest (the commit record), retention (what to keep), lease (one writer), restore (loading
into live parts), loading (a checkpoint read once, then restored), store (commit sequence,
discovery, retention, reading), background (one background job), commit (committers), saver and
async_save (how a training loop saves), distributed_commit (every rank's part), local_first
(local commit, background upload), faults (fault injection), s3 and retry (the S3 client),
diff (checkpoint differences; the `harness ckpt` command is harness/cli/ckpt.py).
"""

from harness.checkpoint.errors import CheckpointCorrupt, CheckpointError
from harness.checkpoint.format import Snapshot, capture
from harness.checkpoint.loading import Checkpoint, Verify
from harness.checkpoint.store import CheckpointRef, CheckpointStore

__all__ = ["Checkpoint", "CheckpointCorrupt", "CheckpointError", "CheckpointRef", "CheckpointStore", "Snapshot",
           "Verify", "capture"]
