"""The exceptions the CLI turns into a one-line message and an exit code that is not "crash".

Raise `UserError` (or a subclass) for anything a user can fix: bad config, a missing file, an
incompatible checkpoint, an unwritable run dir (exit 2: do not retry). Raise `Unavailable` when
infrastructure the run needs (the storage endpoint) did not answer within its retry deadline: no
person has to fix anything, the run is consistent on storage and a later attempt resumes it
(exit 69, STORAGE_UNAVAILABLE: retry with backoff). Either message names the problem and what to
do. Everything else is a bug and keeps its traceback.
"""

from harness.exit_codes import STORAGE_UNAVAILABLE, USER_ERROR


class UserError(Exception):
    """A problem the user can fix; the message says what happened and what to do."""

    exit_code = USER_ERROR


class Unavailable(Exception):
    """Infrastructure did not answer within its retry deadline; the message names the endpoint
    and the operation. Never a `UserError`: nothing about the run's input is wrong."""

    exit_code = STORAGE_UNAVAILABLE


class StorageError(UserError):
    """A storage problem the user can act on (an unknown protocol or a package it needs, a path
    that is a file where a folder is wanted, an unwritable folder, refused credentials, a missing
    bucket, a file over its size limit); the message names the URL and what to change. The
    checkpoint layer's `CheckpointError` is one, so one `except StorageError` catches both; a
    storage outage is not one (`Unavailable`)."""
