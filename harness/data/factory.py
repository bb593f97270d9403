"""`data.factory`: bring your own dataset, indexed by the harness's global order.

Contract. `data.factory = "pkg.mod:build"` names a callable `build(args) -> (train, eval)`;
`args` is `data.args` plus `seq_len` and `seed` (the run's). `train` and `eval` are map-style
sample sources (`harness.data.dataset.SampleSource`):
- `num_samples: int`;
- `__getitem__(i) -> (x, y)`: int64 tensors of `seq_len` tokens (inputs and next-token targets);
- `sample_id(i) -> int`: a stable id of sample `i` (what the batch hash and sample log record).
Optional: `windows(indices) -> int64 [len, seq_len + 1]` (a batch in one read),
`vocab_size: int` (checked against model.args.vocab_size, or given to the model when unset),
`identity() -> dict` (JSON-able; recorded in every checkpoint, and a resume on another identity
is refused, as for token shards).

Sample `i` must be a pure function of `i`: the order (`BatchStream`: epoch permutation, global
batches, rank and worker slices) is the harness's, and the only data state a checkpoint holds is
the cursor. A source that keeps its own state (a generator, a file position, a counter) would
not resume exactly: the completeness check finds such objects reachable from the trainer's
datasets at start-up and refuses them (`train.unregistered_state`). `data.factory` and
`data.args` are math keys: changing them on resume is refused.
"""

from __future__ import annotations

from typing import Any

from harness.data.dataset import SampleSource
from harness.errors import UserError
from harness.models import load_factory

EXAMPLE = "mypackage.data:build"


def build_user_data(factory: str, args: dict[str, Any], seq_len: int, seed: int) -> tuple[SampleSource, SampleSource]:
    """Call the factory and check the shape of what it returns (UserError naming the problem)."""
    result = load_factory(factory, "data factory", EXAMPLE)({**args, "seq_len": seq_len, "seed": seed})
    if not isinstance(result, tuple) or len(result) != 2:
        raise UserError(f"data factory {factory!r} returned a {type(result).__name__}; it must return "
                        f"(train, eval) sample sources (see harness/data/factory.py)")
    for name, source in zip(("train", "eval"), result):
        missing = [a for a in ("num_samples", "__getitem__", "sample_id") if not hasattr(source, a)]
        if missing:
            raise UserError(f"data factory {factory!r}: its {name} source has no {', '.join(missing)}; a sample "
                            f"source needs num_samples, __getitem__(i) -> (x, y) and sample_id(i)")
        if int(source.num_samples) < 1:
            raise UserError(f"data factory {factory!r}: its {name} source is empty")
    return result
