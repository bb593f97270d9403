"""The error the optimizers raise for input a person has to fix.

`OptimError`: a config or a saved state the optimizers cannot take (a pattern that matches no
parameter, a checkpoint's optimizer state that does not fit this bundle); the message names it
and says what to do. It is a `ValueError`, so code that loads state dicts treats it like any
refused state; an application turns it into its own user error (the harness: `UserError`, one
line, exit 2). `optim` imports nothing from the harness: it is the lower layer.
"""


class OptimError(ValueError):
    """A config or saved optimizer state that cannot be used; the message says what to do."""
