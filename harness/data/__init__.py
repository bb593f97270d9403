"""Deterministic, seekable training data.

The order of batches is a pure function of (seed, epoch, position[, rank, world_size]) and the
dataset size; a cursor `{"epoch", "position"}` resumes it in O(1). Modules, in reading order:

- `dataset`: `TokenDataset`, token windows: a text's bytes from any fsspec URL (or the built-in
  `corpus`), or a `TokenStore` such as the shard reader.
- `sources`: the `[data]` config -> train/eval sources: byte text, token shards mixed by weight
  (`shard_index`, `shard_reader`, `integrity`, `mixture`, `document_split`), or a user `factory`.
- `prepare`, `documents`, `columnar`, `tokenizers_spec`, `tokenize_worker`: `harness data prepare`
  (the command and `harness data verify`: harness/cli/data.py).
- `order`: the epoch permutation and how ranks split it.
- `batch`: `Batch`, what the trainer receives, with the cursor it came from.
- `stream`: `BatchStream`, the trainer's endless stream with its cursor `state_dict`.
- `evaluation`: `eval_batches`, the held-out set in fixed order.
- `identity`: `data_identity`, the data's URL and content fingerprint that checkpoints record.
"""

from harness.data.batch import Batch
from harness.data.dataset import VOCAB_SIZE, SampleSource, TokenDataset
from harness.data.evaluation import eval_batches
from harness.data.identity import data_identity
from harness.data.stream import BatchStream

__all__ = ["VOCAB_SIZE", "Batch", "BatchStream", "SampleSource", "TokenDataset", "data_identity", "eval_batches"]
