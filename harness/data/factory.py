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

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from harness.data.dataset import SampleSource
from harness.errors import UserError
from harness.models import call_factory, load_factory

EXAMPLE = "mypackage.data:build"
MAP_STYLE = ("num_samples", "__getitem__", "sample_id")
_WHAT_TO_YIELD = "each next() must give (x, y) or (x, y, sample_id): int64 tensors of seq_len tokens"


def build_user_data(factory: str, args: dict[str, Any], seq_len: int, seed: int, rank: int = 0,
                    world_size: int = 1, folder: Path | None = None) -> tuple[Any, SampleSource]:
    """Call the factory (its module looked for in `folder` too: load_factory) and check the shape
    of what it returns (UserError naming the problem): (train, eval), eval map-style, train
    map-style or a stateful iterator (`is_iterator_source`); the factory's own exception (a wrong
    signature, bad data.args) too, as a model factory's."""
    result = call_factory(load_factory(factory, "data factory", EXAMPLE, folder), factory, "data factory", "data.args",
                          args, {**args, "seq_len": seq_len, "seed": seed, "rank": rank, "world_size": world_size})
    return checked_sources(result, f"data factory {factory!r}", "__getitem__(i) -> (x, y)")


def checked_sources(result: Any, where: str, item: str) -> tuple[Any, SampleSource]:
    """`result` as (train, eval) sample sources, each map-style (`MapSource`: `num_samples` or
    `__len__`, `__getitem__`, `sample_id` or the index) or, for train, a stateful iterator;
    UserError naming `where` (the factory or task) and what is wrong. `item`: what `__getitem__`
    must give, for the message."""
    if not isinstance(result, tuple) or len(result) != 2:
        raise UserError(f"{where} returned a {type(result).__name__}; it must return (train, eval) sample sources "
                        f"(see harness/data/factory.py)")
    sources = []
    for name, source in zip(("train", "eval"), result, strict=True):
        if name == "train" and is_iterator_source(source):
            missing = [m for m in ("state_dict", "load_state_dict") if not callable(getattr(source, m, None))]
            if missing:
                raise UserError(f"{where}: its train source is an iterator without {' and '.join(missing)}, so a "
                                f"checkpoint could not hold its position: add state_dict() -> dict and "
                                f"load_state_dict(state) (see harness/data/factory.py), or return a map-style source")
            sources.append(source)
            continue
        if not hasattr(source, "__getitem__") or not (hasattr(source, "num_samples") or hasattr(source, "__len__")):
            missing = [a for a in ("num_samples (or __len__)", "__getitem__") if not hasattr(source, a.split()[0])]
            raise UserError(f"{where}: its {name} source has no {', '.join(missing)}; a sample source needs "
                            f"num_samples (or __len__), {item} and optionally sample_id(i)")
        source = MapSource.of(source)
        if source.num_samples < 1:
            raise UserError(f"{where}: its {name} source is empty")
        sources.append(source)
    return sources[0], sources[1]


class MapSource:
    """A map-style source as the harness reads it: `num_samples` (the source's, or its `len`),
    `__getitem__`, and `sample_id(i)` (the source's, else `i`). A source with all three (the
    harness's own) is used as it is."""

    def __init__(self, source: Any) -> None:
        self.source = source
        self.num_samples = int(source.num_samples if hasattr(source, "num_samples") else len(source))

    @classmethod
    def of(cls, source: Any) -> Any:
        return source if all(hasattr(source, a) for a in MAP_STYLE) else cls(source)

    def __getitem__(self, index: int) -> Any:
        return self.source[index]

    def sample_id(self, index: int) -> int:
        own = getattr(self.source, "sample_id", None)
        return int(own(index)) if callable(own) else index


def is_iterator_source(source: Any) -> bool:
    """An iterable that is not a map-style sample source: the harness draws from `iter(source)`."""
    return hasattr(source, "__iter__") and not hasattr(source, "__getitem__")


def token_sample(seq_len: int) -> Callable[[Any, int], tuple[tuple[torch.Tensor, torch.Tensor], int]]:
    """How `IteratorStream` reads a language model's iterator: each item `(x, y)` or `(x, y,
    sample_id)`, x and y integer tensors of `seq_len` tokens (UserError naming what is wrong); a
    sample without an id of its own gets its global index."""

    def sample(item: Any, index: int) -> tuple[tuple[torch.Tensor, torch.Tensor], int]:
        if not isinstance(item, (tuple, list)) or len(item) not in (2, 3):
            raise UserError(f"the data.factory iterator gave a {type(item).__name__}: {_WHAT_TO_YIELD}")
        x, y = item[0], item[1]
        for name, t in (("x", x), ("y", y)):
            if not isinstance(t, torch.Tensor) or t.shape != (seq_len,) or t.is_floating_point():
                what = f"a tensor of shape {tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else \
                    f"a {type(t).__name__}"
                raise UserError(f"the data.factory iterator's {name} is {what}: {_WHAT_TO_YIELD} ({seq_len})")
        return (x.long(), y.long()), int(item[2]) if len(item) == 3 else index

    return sample
