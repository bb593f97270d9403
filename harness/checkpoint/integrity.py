"""`harness ckpt verify URL` as a function: every checkpoint a URL names, verified byte for byte,
each verdict and problem printed. The command runs it, and torture's corruption sweep checks what
it says."""

from __future__ import annotations

from typing import Any

from harness.checkpoint.discovery import STEP_DIR, CheckpointRef
from harness.checkpoint.target import open_target
from harness.storage.location import folder_name


def verify_target(url: str, options: dict[str, Any] | None = None) -> int:
    """Print the verdict and problems of the checkpoint folder `url`, or of every checkpoint of
    the run dir `url` (a step folder without a manifest counts as a failed one); 1 if any fails
    or the run dir has none, else 0. `options` are storage options."""
    store, ref = open_target(url, options)
    refs, incomplete = ([ref], []) if ref is not None else store.scan()
    for path in incomplete:
        if step := STEP_DIR.fullmatch(folder_name(path)):
            refs.append(CheckpointRef(int(step[1]), path, store.loc.url_of(path)))
    if not refs:
        print(f"no checkpoints in {store.url}")
        return 1
    bad = 0
    for r in sorted(refs):
        problems = store.verify(r)
        bad += bool(problems)
        print(f"{r.url}: " + ("ok" if not problems else "FAILED"))
        for p in problems:
            print(f"  {p}")
    return 1 if bad else 0
