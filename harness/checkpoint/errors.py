"""The checkpoint layer's error: a `UserError`, so the CLI prints it on one line and exits 2.

Everything the layer raises for bad input (a corrupt or foreign file, a checkpoint that does not
fit the live model, a refused lease, an unknown storage protocol) is a `CheckpointError`. Its
message names the file, tensor or step and says what to do. Bugs stay ordinary exceptions.
"""

from harness.errors import UserError


class CheckpointError(UserError):
    """A checkpoint, store or lease problem the user can act on."""


class CheckpointCorrupt(CheckpointError):
    """A checkpoint's bytes do not match its manifest (found while loading it)."""
