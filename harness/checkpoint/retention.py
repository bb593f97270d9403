"""Which committed checkpoints to keep: the last K plus every M-th step, and always the newest
good one. A pure decision.

`keep_last` must be at least 2: right after a commit the newest checkpoint has not been read
back by anyone, and keeping one older good checkpoint is what makes a torn or bit-rotted newest
one survivable. "Every M-th" means steps divisible by M, so the answer does not depend on which
checkpoints happened to be deleted before. The newest good checkpoint is kept even when newer
(damaged) ones fill the last K; with no good checkpoint nothing is deleted: damaged checkpoints
are the evidence of what went wrong, and may still be repaired. The store applies the decision
only right after a successful commit (the checkpoint it just wrote is the newest good one) or in
`harness ckpt gc` (which verifies to find it), deleting each checkpoint manifest first.
"""

from __future__ import annotations

from collections.abc import Iterable

from harness.checkpoint.errors import CheckpointError


def check_policy(keep_last: int, keep_every: int) -> None:
    if keep_last < 2:
        raise CheckpointError(
            f"keep_last={keep_last}: keep at least 2 checkpoints, the newest may be torn or corrupt "
            f"and resuming then falls back to the one before"
        )
    if keep_every < 0:
        raise CheckpointError(f"keep_every={keep_every}: use 0 (off) or a positive step interval")


def steps_to_keep(committed: Iterable[int], keep_last: int, keep_every: int, newest_good: int | None) -> set[int]:
    """The steps retention keeps among `committed` ones; `newest_good` is the step of the newest
    checkpoint known to be good (None: none is, so every one is kept)."""
    check_policy(keep_last, keep_every)
    steps = sorted(set(committed))
    if newest_good is None:
        return set(steps)
    keep = set(steps[-keep_last:])
    if keep_every:
        keep |= {s for s in steps if s % keep_every == 0}
    return keep | {newest_good}
