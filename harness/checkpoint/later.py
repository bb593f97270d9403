"""State-dict values known only once a snapshot is staged: `Later`.

What it is for: the fingerprints part's `state_hash` (repro/fingerprint.py) is a digest of every
other part's tensors. Computed from the live tensors at the save, it holds the step loop for a
pass over the whole state (0.25 s at 3.38 GiB on the reference machine, against 0.39 s for the
copy into the staging memory: docs/bench-scale.md, "Third pass"). A background
save already copies those tensors, at the same step boundary, and its writer reads each copy once
to write it; the digest can be taken there, on the writer's thread, off the step loop.

The contract, in the order a background saver (save/async_saver.py) runs it:
1. Inside `deferring()`, a part's `state_dict()` may return a `Later` where a value summarizes
   tensors of the same snapshot (a part checks `defers()`); `capture` keeps it in the tree as a
   leaf. Everything a `Later` reads from the live state (names, non-tensor values) it reads then.
2. Still at the step boundary, the saver calls `bind(stage)` on each `Later` of what it writes
   (`later_values`). For each tensor it needs, the `Later` offers a `Feed`: `stage(tensor, feed)`
   is True when the saver's staging will feed it that tensor's bytes (the copy taken at this
   boundary) and call `finish()`; False, and the `Later` reads the live tensor now.
3. The writer writes `state.json` after every tensor file (format.py, `snapshot_files`), and
   `dump_state` writes each `Later` as its `value()`, by then fed.
Outside `deferring()` (a synchronous save, a test harness) a part computes its values at once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Protocol

import torch

_DEFERRING: ContextVar[bool] = ContextVar("harness_checkpoint_deferring", default=False)


class Feed(Protocol):
    """Receives one staged tensor's bytes, piece by piece in order, on the writer's thread."""

    def update(self, piece: memoryview) -> None: ...

    def finish(self) -> None: ...


Stage = Callable[[torch.Tensor, Feed], bool]


class Later:
    """A JSON value of a state dict that is computed from the snapshot's staged tensors (module docstring)."""

    def bind(self, stage: Stage) -> None:
        """Step 2 of the contract: at the step boundary, before any staged byte is fed."""
        raise NotImplementedError

    def value(self) -> Any:
        """Step 3: the JSON value, once every tensor fed to it is finished."""
        raise NotImplementedError


@contextmanager
def deferring() -> Iterator[None]:
    """Within it, the parts' `state_dict()`s may return `Later` values (the caller binds them)."""
    token = _DEFERRING.set(True)
    try:
        yield
    finally:
        _DEFERRING.reset(token)


def defers() -> bool:
    """Whether a part's `state_dict()` runs inside `deferring()`."""
    return _DEFERRING.get()


def later_values(tree: Any) -> Iterator[Later]:
    """Every `Later` in a captured tree (dicts and lists, as `capture` builds them)."""
    if isinstance(tree, Later):
        yield tree
    elif isinstance(tree, dict):
        for child in tree.values():
            yield from later_values(child)
    elif isinstance(tree, list):
        for child in tree:
            yield from later_values(child)


def json_value(value: Any) -> Any:
    """`json.dumps`'s `default`: a `Later` as its value; anything else is not JSON-able."""
    if isinstance(value, Later):
        return value.value()
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")
