"""The storage layer's error: a `UserError`, so the CLI prints it on one line and exits 2.

Everything the layer raises for a problem a person fixes (an unknown protocol or a missing
package for it, a path that is a file where a folder is wanted, an unwritable folder, refused
credentials, a missing bucket, a file over its size limit) is a `StorageError` naming the URL and
what to change. The checkpoint layer's `CheckpointError` is one too, so one `except StorageError`
catches both; a transient outage is not one (`StorageUnavailable`, harness/storage/retry.py).
"""

from __future__ import annotations

from harness.errors import UserError


class StorageError(UserError):
    """A storage problem the user can act on."""
