"""The one exception type the CLI turns into a one-line message and exit code 2.

Raise `UserError` (or a subclass) for anything a user can fix: bad config, a missing file, an
incompatible checkpoint, an unwritable run dir. The message must name the problem and what to do.
Everything else is a bug and keeps its traceback.
"""


class UserError(Exception):
    """A problem the user can fix; the message says what happened and what to do."""

    exit_code = 2
