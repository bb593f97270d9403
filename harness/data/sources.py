"""From the `[data]` config to the train and eval sample sources, their vocabulary and identity.

Three kinds of data:
- `data.url` (or nothing: the built-in corpus): a text file's bytes, vocabulary 256. The
  quickstart's path, unchanged.
- `data.sources = [{url, weight}, ...]`: prepared token-shard datasets (`harness data prepare`),
  mixed by weight (mixture.py). Start-up reads each `index.json` and nothing else. Every source
  must come from the same tokenizer (the ids would mean different things otherwise). Each
  source's last `eval_fraction` of windows is held out, cut at a document end when one is near
  (document_split.py); the eval set is the mixture of those, read in one fixed shuffled order
  (so a short evaluation sees every source); or, with `data.eval_sources`, evaluation reads
  those datasets whole and training every document of the sources.
- `data.factory`: the user's own sources (factory.py): map-style, or a stateful iterator for
  training.

`identity` is what a checkpoint records about the data beyond the config's math keys: for
sources, each index's sha256 and weight in order (the URL may change: a dataset copied to
another bucket is the same dataset) and, when eval is held out of them, how many windows train
(so a change of the split rule is a refused resume, not other training data in silence).
Resuming on data with another identity is refused, the difference named (`identity_changes`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from harness.data.batch import Collate
from harness.data.dataset import SampleSource, TokenDataset
from harness.data.document_split import split_by_document
from harness.data.factory import build_user_data, token_sample
from harness.data.identity import data_identity
from harness.data.iterator_stream import SampleOf, as_sample
from harness.data.mixture import Mixture
from harness.data.order import epoch_permutation
from harness.data.shard_reader import ShardReader
from harness.errors import UserError
from harness.repro.splitmix import derive_seed
from harness.storage.location import open_location

_EVAL_ORDER_SALT = 0x4556414C  # "EVAL"


@dataclass(frozen=True)
class TrainData:
    """A run's data: the `train` and `eval` sources, the vocabulary they declare, their identity,
    how samples become a batch (`collate`: None, torch's default) and how an iterator's items
    become samples (`sample`, iterator_stream.py)."""

    train: SampleSource | Any  # Any: a user's stateful iterator (factory.py)
    eval: SampleSource
    vocab_size: int | None  # None: byte text (the model's default 256), or a user dataset that does not say
    # text: data_identity(); shards: index hashes + weights; None: a user factory without one
    identity: dict[str, Any] | None
    collate: Collate | None = None
    sample: SampleOf = as_sample

    def sizes(self, seq_len: int) -> dict[str, Any]:
        """How much data trains and how much is held out, in windows and in the tokens they
        predict (`seq_len` each); a stateful iterator's training size is not known."""
        train = getattr(self.train, "num_samples", None)
        held_out = self.eval.num_samples
        sizes: dict[str, Any] = {"eval_windows": held_out, "eval_tokens": held_out * seq_len}
        if train is not None:
            sizes.update(train_windows=train, train_tokens=train * seq_len,
                         eval_share=round(held_out / (train + held_out), 4))
        return sizes


def open_data(data_cfg: Any, seed: int, rank: int = 0, world_size: int = 1) -> TrainData:
    """The datasets `data_cfg` (a `DataSection`) names, for `rank` of `world_size` (only a user
    factory is told: the harness's own sources are split by the stream). Raises UserError for
    missing or inconsistent datasets."""
    if data_cfg.factory is not None:
        train, held_out = build_user_data(data_cfg.factory, data_cfg.args, data_cfg.seq_len, seed, rank, world_size,
                                          data_cfg.code_folder)
        identity = getattr(train, "identity", None)
        return TrainData(train, held_out, getattr(train, "vocab_size", None),
                         {"factory": identity()} if identity is not None else None,
                         sample=token_sample(data_cfg.seq_len))
    if not data_cfg.sources:
        dataset = TokenDataset.from_url(data_cfg.url, data_cfg.seq_len, data_cfg.storage_options)
        train, held_out = dataset.split(data_cfg.eval_fraction)
        # The model's default vocabulary is the bytes; the identity is the file's size and end blocks.
        return TrainData(train, held_out, None, data_identity(data_cfg.url, data_cfg.storage_options))
    readers = _readers("data.sources", data_cfg.sources, data_cfg)
    eval_readers = _readers("data.eval_sources", data_cfg.eval_sources, data_cfg)
    tokenizers = {r.index.tokenizer["sha256"] for r in readers + eval_readers}
    if len(tokenizers) > 1:
        urls = [s.url for s in data_cfg.sources + data_cfg.eval_sources]
        raise UserError(f"data.sources / eval_sources come from {len(tokenizers)} different tokenizers "
                        f"({', '.join(urls)}); prepare every source with the same one")
    weights = [s.weight for s in data_cfg.sources]
    identity = {"sources": [{"index_sha256": r.index.sha256, "weight": w}
                            for r, w in zip(readers, weights, strict=True)]}
    if eval_readers:  # evaluation has its own datasets: train on every document of the sources
        train = Mixture([TokenDataset(r, data_cfg.seq_len) for r in readers], weights, seed)
        held_out = Mixture([TokenDataset(r, data_cfg.seq_len) for r in eval_readers],
                           [s.weight for s in data_cfg.eval_sources], seed)
    else:
        splits = [split_by_document(r, data_cfg.seq_len, data_cfg.eval_fraction) for r in readers]
        train = Mixture([t for t, _ in splits], weights, seed)
        held_out = Mixture([e for _, e in splits], weights, seed)
        # Which windows train is decided by the split rule, not by the index and config alone: recorded,
        # a resume under another rule (an older harness held out eval_fraction of the documents) is refused.
        for source, (part, _) in zip(identity["sources"], splits, strict=True):
            source["train_windows"] = part.num_samples
    order = epoch_permutation(derive_seed(seed, _EVAL_ORDER_SALT), 0, held_out.num_samples)
    return TrainData(train, Reordered(held_out, order), readers[0].index.vocab_size, identity)


def _readers(key: str, specs: list[Any], data_cfg: Any) -> list[ShardReader]:
    """A reader of each source of `key` (`data.sources` / `data.eval_sources`); a url that names no
    prepared dataset (a file, or a folder without a valid index.json) is a UserError naming it."""
    readers = []
    for n, spec in enumerate(specs):
        options = _storage_options(spec, data_cfg)
        loc = open_location(spec.url, options)
        if loc.fs.isfile(loc.root):
            text = "; to train on a text file's bytes set data.url instead" if key == "data.sources" else ""
            raise UserError(f"{key}[{n}].url = {spec.url!r} is a file; a source url must be the folder of a "
                            f"dataset made by `harness data prepare` (the folder holding index.json){text}")
        readers.append(ShardReader.open(spec.url, options, data_cfg.hash_check))
    return readers


def _storage_options(spec: Any, data_cfg: Any) -> dict | None:
    return spec.storage_options or data_cfg.storage_options or None


def identity_changes(saved: dict[str, Any] | None, current: dict[str, Any] | None) -> dict[str, tuple[Any, Any]]:
    """What differs between a checkpoint's data identity and this run's: name -> (then, now).
    A checkpoint written before identities were recorded (`saved` None) is only checked for a
    switch to token shards."""
    if _content(saved) == _content(current) or (saved is None and "sources" not in (current or {})):
        return {}
    if "sources" not in (saved or {}) or "sources" not in (current or {}):
        same_kind = saved is not None and current is not None and "url" in saved and "url" in current
        return {"data content" if same_kind else "data": (_identity_kind(saved), _identity_kind(current))}
    assert saved is not None and current is not None  # both have sources (above)
    before, after = saved["sources"], current["sources"]
    if len(before) != len(after):
        return {"data.sources": (f"{len(before)} sources", f"{len(after)} sources")}
    changes: dict[str, tuple[Any, Any]] = {}
    for n, (b, a) in enumerate(zip(before, after, strict=True)):
        if b["index_sha256"] != a["index_sha256"]:
            changes[f"data.sources[{n}] index sha256"] = (b["index_sha256"][:12], a["index_sha256"][:12])
        if b["weight"] != a["weight"]:
            changes[f"data.sources[{n}] weight"] = (b["weight"], a["weight"])
        if b.get("train_windows") != a.get("train_windows"):
            changes[f"data.sources[{n}] training windows (the eval split)"] = (
                b.get("train_windows", "unrecorded: eval_fraction of the documents held out"),
                a.get("train_windows", "no split: data.eval_sources"))
    return changes or {"data identity": (saved, current)}


def _content(identity: dict[str, Any] | None) -> dict[str, Any] | None:
    """An identity without a text file's URL: the config's `data.url` is compared on its own."""
    return {k: v for k, v in identity.items() if k != "url"} if identity and "sources" not in identity else identity


def _identity_kind(identity: dict[str, Any] | None) -> str:
    """A short description of an identity for a message: which data and, for text, its content."""
    if not identity:
        return "unrecorded"
    if "sources" in identity:
        return f"{len(identity['sources'])} token-shard sources"
    if "factory" in identity:
        return f"data.factory {identity['factory']}"
    return (f"text {identity.get('url') or 'built-in corpus'} ({identity.get('size')} bytes, "
            f"sha256 of first/last MiB {str(identity.get('head'))[:8]}/{str(identity.get('tail'))[:8]})")


class Reordered:
    """`dataset` read in the order `order` (a permutation of its slots)."""

    def __init__(self, dataset: Mixture, order: torch.Tensor) -> None:
        self.dataset = dataset
        self.order = order
        self.num_samples = dataset.num_samples

    def sample_id(self, index: int) -> int:
        return self.dataset.sample_id(int(self.order[index]))

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.dataset[int(self.order[index])]

    def windows(self, indices: list[int]) -> torch.Tensor:
        return self.dataset.windows([int(self.order[i]) for i in indices])
