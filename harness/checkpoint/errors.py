"""The checkpoint layer's error: a `StorageError` (a `UserError`), so the CLI prints it on one line and exits 2.

Everything the layer raises for bad input (a corrupt or foreign file, a checkpoint that does not
fit the live model, a refused lease, an unknown storage protocol) is a `CheckpointError`. Its
message names the file, tensor or step and says what to do. Bugs stay ordinary exceptions.

A save that fails for a reason a person has to fix (a full disk or quota, a read-only mount, a
permission) is a `CheckpointError` too (`failed_save`), with the same wording whether the save
ran in the step loop or in the background, and saying truthfully what is still committed.
"""

from __future__ import annotations

import errno
import os

from harness.errors import StorageError

# Storage errors that retrying or restarting cannot heal.
USER_FIXABLE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM})


class CheckpointError(StorageError):
    """A checkpoint, store or lease problem the user can act on."""


class CheckpointCorrupt(CheckpointError):
    """A checkpoint's bytes do not match its manifest (found while loading it)."""


def storage_errno(error: BaseException) -> int | None:
    """The errno of the first OSError in `error`'s chain (itself, its cause, its context)."""
    seen: set[int] = set()
    link: BaseException | None = error
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        if isinstance(link, OSError) and link.errno is not None:
            return link.errno
        link = link.__cause__ or link.__context__
    return None


def still_committed(newest_committed: int | None) -> str:
    """What a failed save leaves behind, in words (the commit is atomic: nothing of it exists)."""
    if newest_committed is None:
        return "nothing was committed, and no earlier checkpoint of this run exists: a restart starts from step 0"
    return f"nothing of it was committed; the checkpoint at step {newest_committed} is still the newest good one"


def failed_save(step: int, error: BaseException, newest_committed: int | None, where: str) -> CheckpointError | None:
    """The error to raise for the save of `step` to `where` that failed with `error`, when a
    person must fix the cause (`USER_FIXABLE_ERRNOS`); None for any other failure."""
    code = storage_errno(error)
    if code not in USER_FIXABLE_ERRNOS:
        return None
    fix = ("free space (or quota) there, or choose another --run-dir" if code in (errno.ENOSPC, errno.EDQUOT)
           else "make it writable, or choose another --run-dir")
    return CheckpointError(f"the checkpoint at step {step} could not be written to {where}: "
                           f"{errno.errorcode.get(code, code)} ({os.strerror(code)}); {fix}; "
                           f"{still_committed(newest_committed)}")

