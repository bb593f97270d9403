"""`data.factory`: bring your own dataset, as map-style sources the harness's global order
indexes, or as a stateful iterator that keeps its own position.

Contract. `data.factory = "pkg.mod:build"` names a callable `build(args) -> (train, eval)`;
`args` is `data.args` plus `seq_len` and `seed` (the run's) and `rank` and `world_size` (this
process's place in the job). `eval` is a map-style sample source; `train` is one too, or a
stateful iterator.

A map-style sample source (`harness.data.dataset.SampleSource`):
- `num_samples: int`;
- `__getitem__(i) -> (x, y)`: int64 tensors of `seq_len` tokens (inputs and next-token targets);
- `sample_id(i) -> int`: a stable id of sample `i` (what the batch hash and sample log record).
Optional: `windows(indices) -> int64 [len, seq_len + 1]` (a batch in one read).
Sample `i` must be a pure function of `i`: the order (`BatchStream`: epoch permutation, global
batches, rank and worker slices) is the harness's, and the only data state a checkpoint holds is
the cursor; so it resumes at any world size and any `data.num_workers`. A source that keeps its
own state (a generator, a file position, a counter) would not resume exactly: the completeness
check finds such objects reachable from the trainer's datasets at start-up and refuses them
(`train.unregistered_state`).

A stateful iterator (`train` only; read by `IteratorStream`, iterator_stream.py):
- `iter(train)` gives the iterator the harness draws from (`train` itself, or a fresh iterator
  that continues from `train`'s state, as torchdata's StatefulDataLoader does); each `next()`
  gives one sample, `(x, y)` or `(x, y, sample_id)`, x and y int64 tensors of `seq_len` tokens;
  it never ends (it starts its next epoch itself);
- `state_dict() -> dict`: its position after the samples handed out so far: dicts, lists,
  tensors, str/int/float/bool/None only (the checkpoint is JSON plus safetensors, never pickle;
  tuples come back as lists). Checked at start: a value the format cannot hold is refused then,
  naming its path, not at the first save;
- `load_state_dict(state)`: go back to that position (the harness then calls `iter(train)`).
An iterable without `state_dict`/`load_state_dict` is refused at start: the harness could not
checkpoint where it is. The iterator is read in the training process (`data.num_workers` must
be 0; read ahead inside it if you need to, keeping `state_dict()` at the samples handed out).
Sharding across ranks is the iterator's: the factory gets `rank` and `world_size` and must
give each rank different samples. A checkpoint holds each rank's iterator state, so a resume
must use the same number of ranks (another world size is refused at load, naming both).

Optional on `train` (either kind): `vocab_size: int` (checked against model.args.vocab_size, or
given to the model when unset), `identity() -> dict` (JSON-able; recorded in every checkpoint,
and a resume on another identity is refused, as for token shards). `data.factory` and
`data.args` are math keys: changing them on resume is refused.
"""

from __future__ import annotations

from typing import Any

from harness.data.dataset import SampleSource
from harness.errors import UserError
from harness.models import call_factory, load_factory

EXAMPLE = "mypackage.data:build"
MAP_STYLE = ("num_samples", "__getitem__", "sample_id")


def build_user_data(factory: str, args: dict[str, Any], seq_len: int, seed: int, rank: int = 0,
                    world_size: int = 1) -> tuple[Any, SampleSource]:
    """Call the factory and check the shape of what it returns (UserError naming the problem):
    (train, eval), eval map-style, train map-style or a stateful iterator (`is_iterator_source`);
    the factory's own exception (a wrong signature, bad data.args) too, as a model factory's."""
    result = call_factory(load_factory(factory, "data factory", EXAMPLE), factory, "data factory", "data.args", args,
                          {**args, "seq_len": seq_len, "seed": seed, "rank": rank, "world_size": world_size})
    if not isinstance(result, tuple) or len(result) != 2:
        raise UserError(f"data factory {factory!r} returned a {type(result).__name__}; it must return "
                        f"(train, eval) sample sources (see harness/data/factory.py)")
    for name, source in zip(("train", "eval"), result, strict=True):
        if name == "train" and is_iterator_source(source):
            missing = [m for m in ("state_dict", "load_state_dict") if not callable(getattr(source, m, None))]
            if missing:
                raise UserError(f"data factory {factory!r}: its train source is an iterator without "
                                f"{' and '.join(missing)}, so a checkpoint could not hold its position: add "
                                f"state_dict() -> dict and load_state_dict(state) (see harness/data/factory.py), "
                                f"or return a map-style source")
            continue
        missing = [a for a in MAP_STYLE if not hasattr(source, a)]
        if missing:
            raise UserError(f"data factory {factory!r}: its {name} source has no {', '.join(missing)}; a sample "
                            f"source needs num_samples, __getitem__(i) -> (x, y) and sample_id(i)")
        if int(source.num_samples) < 1:
            raise UserError(f"data factory {factory!r}: its {name} source is empty")
    return result


def is_iterator_source(source: Any) -> bool:
    """An iterable that is not a map-style sample source: the harness draws from `iter(source)`."""
    return hasattr(source, "__iter__") and not all(hasattr(source, a) for a in MAP_STYLE)
