"""Checkpoints: a training state as safetensors + JSON files, committed atomically to any fsspec URL.

    store = CheckpointStore("runs/a")          # or "s3://bucket/run", "memory://t"
    with store.lease():
        ref = store.save(step, parts, meta={"config": cfg})
    ref = store.latest_good()                   # newest checkpoint that verifies
    meta = store.load(ref, parts)               # streams tensors into the live storage

Modules, bottom up: filesystem (URL -> fsspec filesystem), location (durable writes and hashed
reads on a Location), digest, tensorfile (safetensors read/write), format (what the files hold),
manifest (the commit record), discovery (finding committed checkpoints without reading data;
no torch), retention (what to keep), lease (one writer), restore (loading into live parts),
loading (a checkpoint read once, then restored), store (commit sequence, discovery, retention,
reading), background (one background job), commit (committers), saver and
async_save (how a training loop saves), distributed_commit (every rank's part), local_first
(local commit, background upload), faults (fault injection), s3 and retry (the S3 client),
diff (checkpoint differences; the `harness ckpt` command is harness/cli/ckpt.py).
"""

from importlib import import_module

# The names below are loaded on first use, so that importing a torch-free module of this package
# (errors, location, lease, discovery) does not import torch: `harness train` reads checkpoint.errors
# before it checks the config, so a config it refuses costs no torch import (three CPU-seconds), and
# the supervisor watches its child's progress through discovery alone.
_EXPORTS = {"CheckpointCorrupt": "errors", "CheckpointError": "errors", "Snapshot": "format", "capture": "format",
            "Checkpoint": "loading", "Verify": "loading", "CheckpointRef": "discovery", "CheckpointStore": "store"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{_EXPORTS[name]}"), name)
