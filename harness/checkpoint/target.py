"""What a URL names: a run dir, or one checkpoint folder of a run dir. The one reading of such a
URL, for `harness ckpt` (a run dir or a checkpoint) and `harness train --resume URL` (a checkpoint).
"""

from __future__ import annotations

from typing import Any

from harness.checkpoint.discovery import CHECKPOINTS_DIR, STEP_DIR, CheckpointRef
from harness.checkpoint.errors import CheckpointError
from harness.checkpoint.manifest import MANIFEST_FILE, parse_manifest
from harness.checkpoint.store import CheckpointStore
from harness.storage.location import folder_name, open_location, read_bytes


def locate(url: str, options: dict[str, Any] | None = None) -> tuple[CheckpointStore, CheckpointRef | None]:
    """(the store of the run dir, the checkpoint folder or None) that `url` names; `options` are
    storage options. A folder named `step-N` is the checkpoint of step N, whether it exists or not
    (the caller says what a missing one means), and so is any other folder holding a manifest
    (the step its manifest records); its run dir is the folder above `checkpoints/`, or above the
    checkpoint folder when that is not in one. Anything else names a run dir."""
    loc = open_location(url, options)
    name, parent = folder_name(loc.root), loc.root.rstrip("/").rsplit("/", 1)[0]
    manifest = f"{loc.root}/{MANIFEST_FILE}"
    step_name = STEP_DIR.fullmatch(name)
    if step_name:
        step = int(step_name[1])
    elif loc.fs.exists(manifest):
        step = parse_manifest(read_bytes(loc, manifest, 1 << 24), loc.url_of(manifest)).step
    else:
        return CheckpointStore(url, storage_options=options), None
    run = parent.rsplit("/", 1)[0] if folder_name(parent) == CHECKPOINTS_DIR else parent
    store = CheckpointStore(loc.url_of(run), storage_options=options)
    return store, CheckpointRef(step, loc.root, loc.url_of(loc.root))


def open_target(url: str, options: dict[str, Any] | None = None) -> tuple[CheckpointStore, CheckpointRef | None]:
    """`locate(url, options)` of a folder that exists; `CheckpointError` when there is none."""
    store, ref = locate(url, options)
    if not store.loc.fs.isdir(store.loc.root if ref is None else ref.path):
        raise CheckpointError(f"{url}: no such run dir or checkpoint folder")
    return store, ref
